from nmbus.cli import main

main()
