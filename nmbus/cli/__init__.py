"""The ``nmbus`` command line: a thin layer over the library.

Each command group lives in its own module and is registered here. Settings
are built once, from options and ``NMBUS_*`` variables, in the command itself.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="nmbus",
    help="nmbus: a message bus on PostgreSQL queue tables.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """nmbus: a message bus on PostgreSQL queue tables."""


def _register() -> None:
    # Command modules, one group each. Imported here so `nmbus --help` lists them.
    from nmbus.cli import report as _report  # noqa: F401
    from nmbus.cli import version as _version  # noqa: F401


_register()


def main() -> None:
    app()
