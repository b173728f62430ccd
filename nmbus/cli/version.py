from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version

import typer

from nmbus.cli import app


@app.command()
def version() -> None:
    """Print the installed nmbus version."""
    try:
        typer.echo(_dist_version("nmbus"))
    except PackageNotFoundError:
        typer.echo("unknown (not installed)")
