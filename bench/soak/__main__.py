"""``python -m bench.soak [OPTIONS]``: the kill soak (see :mod:`bench.soak.cli`)."""

from bench.soak.cli import app

if __name__ == "__main__":
    app(prog_name="python -m bench.soak")
