"""``python -m bench MODE ...``: the modes of :mod:`bench.modes` (see bench/README.md)."""

from bench.cli import app

if __name__ == "__main__":
    app(prog_name="python -m bench")
