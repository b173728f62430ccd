"""``nmbus version`` and ``nmbus --version``."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version

import typer

from nmbus.cli import app


def installed_version() -> str:
    try:
        return _dist_version("nmbus")
    except PackageNotFoundError:
        return "unknown (not installed)"


@app.command()
def version() -> None:
    """Print the installed nmbus version (as `nmbus --version`)."""
    typer.echo(installed_version())
