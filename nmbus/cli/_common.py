"""What every command shares: options, settings, the operations layer, errors, tables and JSON."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass
from datetime import date, datetime, timedelta
from decimal import Decimal
from enum import StrEnum
from typing import Annotated, Any, NoReturn, TextIO, TypeVar, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import structlog
import typer
from rich.console import Console
from rich.markup import escape

from nmbus.cli._table import Column, Grid, age_text
from nmbus.errors import NmbusError
from nmbus.logs import scrub
from nmbus.names import validate_queue_name
from nmbus.ops.admin import Admin
from nmbus.settings import Settings

T = TypeVar("T")

DsnOption = Annotated[
    str | None,
    typer.Option("--dsn", envvar="NMBUS_DSN", help="PostgreSQL DSN [env: NMBUS_DSN]"),
]
SchemaOption = Annotated[
    str | None,
    typer.Option("--schema", envvar="NMBUS_SCHEMA_NAME", help="schema of the queue tables"),
]
JsonOption = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]
YesOption = Annotated[bool, typer.Option("--yes", "-y", help="do not ask for confirmation")]

console = Console()
errors = Console(stderr=True)


class LogLevel(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


class LogFormat(StrEnum):
    console = "console"
    json = "json"


@dataclass
class GlobalOptions:
    """What the root callback was given; reset before each invocation."""

    debug: bool = False
    log_level: LogLevel | None = None  # None: the command's default (warning; worker: info)
    log_format: LogFormat = LogFormat.console

    def reset(self) -> None:
        self.debug, self.log_level, self.log_format = False, None, LogFormat.console


options = GlobalOptions()


class CommandError(Exception):
    """A command cannot go on: printed as one ``error:`` line, exit with ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class _Stderr:
    """Whatever sys.stderr is when a line is written (it may be replaced after configuring)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "warning", fmt: str = "console") -> None:
    """The CLI owns output: log lines go to stderr, so stdout stays clean for --json."""
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(cast(TextIO, _Stderr())),
        cache_logger_on_first_use=False,
    )


def settings(dsn: str | None, schema: str | None, **extra: Any) -> Settings:
    """Build the settings once, from options first and NMBUS_* variables second."""
    given = {"dsn": dsn, "schema_name": schema, **extra}
    built = Settings(**{k: v for k, v in given.items() if v is not None})
    if not built.dsn:
        fail("no database: pass --dsn postgresql://... or set NMBUS_DSN", code=2)
    return built


def one_line(text: str) -> str:
    """What an error says, on one line, without passwords."""
    return scrub(" ".join(part.strip() for part in text.splitlines() if part.strip()))


def print_error(message: str) -> None:
    # soft_wrap: a long message stays one line whatever the terminal width.
    errors.print(f"[red]error:[/red] {escape(one_line(message))}", highlight=False, soft_wrap=True)


def fail(message: str, code: int = 1) -> NoReturn:
    """Stop the command: ``message`` goes to stderr as one line, the exit code is ``code``."""
    raise CommandError(message, code)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine; what it raises becomes one line in nmbus.cli._group."""
    return asyncio.run(coro)


def operate(cfg: Settings, call: Callable[[Admin], Awaitable[T]]) -> T:
    """Run ``call`` on the operations layer, on a database that holds the nmbus schema.

    Commands read (and change rows) through it, never create: a missing
    schema is an error here, not a reason to install one. Only `queues create`
    and a starting Bus create schema objects.
    """

    async def calling() -> T:
        async with Admin.from_settings(cfg) as admin:
            if not await admin.schema_exists():
                fail(
                    f"no nmbus schema {cfg.schema_name!r} in this database: no queues "
                    "(check --dsn and --schema; a starting Bus or `nmbus queues create` makes it)"
                )
            return await call(admin)

    return run(calling())


_KEYWORD = re.compile(r"(\w+)\s*=\s*('(?:[^'\\]|\\.)*'|\S+)")


def server_address(dsn: str) -> str:
    """``host:port/database`` of a DSN: which server, never who connects or with what password."""
    try:
        if "://" in dsn:
            parts = urlsplit(dsn)
            given = dict(parse_qsl(parts.query))
            host = parts.hostname or given.get("host")
            port = str(parts.port or given.get("port") or 5432)
            database = unquote(parts.path.lstrip("/")) or given.get("dbname")
        else:  # libpq keywords: host=... port=... dbname=...
            given = {k: v.strip("'") for k, v in _KEYWORD.findall(dsn)}
            host, port, database = given.get("host"), given.get("port", "5432"), given.get("dbname")
    except ValueError:  # a port that is not a number: the connection will say so
        return "the server of the DSN given"
    host = host or "localhost"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6
    return f"{host}:{port}/{database or '(default database)'}"


def queue_name(name: str) -> str:
    try:
        return validate_queue_name(name)
    except NmbusError as exc:
        fail(str(exc), code=2)  # a bad argument


def _plain(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Decimal):
        return float(value)
    return value


def emit_json(data: Any) -> None:
    """Print ``data`` as JSON on stdout (plain, no colours, one document)."""
    sys.stdout.write(json.dumps(data, default=_plain, ensure_ascii=False, indent=2) + "\n")


def plain(result: Any) -> dict[str, Any]:
    """A result of the operations layer (a dataclass) as a dict of JSON-ready values."""
    return {k: _plain(v) for k, v in asdict(result).items()}


def table(
    title: str | None,
    columns: Sequence[str | Column],
    rows: Sequence[Sequence[Any]],
    *,
    empty: str | None = None,
    split: bool = True,
) -> None:
    """Print a table on stdout that fits the terminal (see nmbus.cli._table)."""
    console.print(Grid(title, columns, rows, empty=empty, split=split))


def seconds_text(value: float | None) -> str:
    """A number of seconds as a short age (``42s``, ``3m20s``, ``1h05m``); None as ``-``."""
    return age_text(value)


_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
# Beyond this, now() minus the age is before any timestamp PostgreSQL can hold.
_LONGEST_AGE = timedelta(days=36_500)


def parse_age(text: str, option: str | None = None) -> timedelta:
    """``90s``, ``30m``, ``12h``, ``7d``, ``2w`` or plain seconds; at most 100 years."""
    match = _AGE.match(text)
    if not match:
        raise typer.BadParameter(
            f"{text!r} is not an age like 90s, 30m, 12h, 7d or 2w", param_hint=option
        )
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds > _LONGEST_AGE.total_seconds():
        raise typer.BadParameter(
            f"{text!r} is longer than {_LONGEST_AGE.days}d, the longest age accepted",
            param_hint=option,
        )
    return timedelta(seconds=seconds)


def confirm(question: str, yes: bool) -> None:
    """Ask before a destructive action; without a terminal or a yes, refuse (exit 1)."""
    if yes:
        return
    if not sys.stdin.isatty():
        fail(f"{question} Refusing without --yes (no terminal to ask).")
    if not typer.confirm(question, default=False):
        fail("aborted, nothing changed")
