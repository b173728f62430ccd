"""The ``nmbus`` command line: a thin layer over the library.

Each command group lives in its own module and is registered here. Settings
are built once, from options and ``NMBUS_*`` variables, in the command itself.
A command parses its arguments, calls the operations layer
(:class:`nmbus.ops.admin.Admin`, shared with any other operator's tool) and
renders what it returns as a table or JSON: no SQL and no driver here.
Errors become one line on stderr in one place, :mod:`nmbus.cli._group`.
"""

from __future__ import annotations

from typing import Annotated

import typer

from nmbus.cli._common import LogFormat, LogLevel, configure_logging, options
from nmbus.cli._group import NmbusGroup

app = typer.Typer(
    name="nmbus",
    help="nmbus: a message bus on PostgreSQL queue tables.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=NmbusGroup,
)


def _show_version(value: bool) -> None:
    if value:
        from nmbus.cli.version import installed_version

        typer.echo(installed_version())
        raise typer.Exit()


@app.callback()
def _root(
    _version: Annotated[
        bool,
        typer.Option(
            "--version",
            is_eager=True,
            callback=_show_version,
            expose_value=True,
            help="print the installed nmbus version and exit",
        ),
    ] = False,
    debug: Annotated[
        bool,
        typer.Option("--debug", "-v", help="on an error, print its traceback too"),
    ] = False,
    log_level: Annotated[
        LogLevel | None,
        typer.Option(
            "--log-level",
            case_sensitive=False,
            metavar="LEVEL",
            help="debug, info, warning or error: log lines at this level and above "
            "(default: warning; worker: info)",
            show_default=False,
        ),
    ] = None,
    log_format: Annotated[
        LogFormat,
        typer.Option(
            "--log-format",
            case_sensitive=False,
            metavar="FORMAT",
            help="console or json: log lines as text or as JSON objects",
        ),
    ] = LogFormat.console,
) -> None:
    """nmbus: a message bus on PostgreSQL queue tables."""
    options.debug = debug
    options.log_level = log_level
    options.log_format = log_format
    # Log lines go to stderr, so stdout stays clean for --json. Configured once,
    # here; `nmbus worker` raises the default level to info.
    configure_logging(log_level or LogLevel.warning, log_format)


def _register() -> None:
    # Command modules, one group each. Imported here so `nmbus --help` lists them.
    from nmbus.cli import asyncapi as _asyncapi  # noqa: F401
    from nmbus.cli import cancel as _cancel  # noqa: F401
    from nmbus.cli import cleanup as _cleanup  # noqa: F401
    from nmbus.cli import dashboard as _dashboard  # noqa: F401
    from nmbus.cli import failed as _failed  # noqa: F401
    from nmbus.cli import forward as _forward  # noqa: F401
    from nmbus.cli import health as _health  # noqa: F401
    from nmbus.cli import queues as _queues  # noqa: F401
    from nmbus.cli import report as _report  # noqa: F401
    from nmbus.cli import segments as _segments  # noqa: F401
    from nmbus.cli import status as _status  # noqa: F401
    from nmbus.cli import subscriptions as _subscriptions  # noqa: F401
    from nmbus.cli import version as _version  # noqa: F401
    from nmbus.cli import worker as _worker  # noqa: F401
    # bench and demo are loaded when they run: see NmbusGroup.lazy.


_register()


def main() -> None:
    app()
