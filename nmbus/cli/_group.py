"""The root command: where every failure becomes one line, and heavy commands load late.

Whatever a command raises ends here, in ``NmbusGroup.main`` (``NmbusCommand.main``
for a command that is a program of its own): the same method runs for the
``nmbus`` script and for ``typer.testing.CliRunner``. An operator
sees ``error: <what is wrong>`` on stderr and a non-zero exit code; with
``--debug`` (``-v``) the traceback comes first. Exit codes: 1 the command
failed or refused, 2 wrong usage (a bad option, argument or NMBUS_* setting).
"""

from __future__ import annotations

import importlib
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import typer
import typer.main
from pydantic import ValidationError
from typer.core import TyperCommand, TyperGroup

from nmbus.cli._common import CommandError, options, print_error
from nmbus.errors import InvalidQueueName, InvalidSetting, NmbusError
from nmbus.postgres.errors import driver_error_line


class NmbusGroup(TyperGroup):
    """``nmbus``: lazy commands, and one place that turns exceptions into one line."""

    # Command name -> module defining ``command`` (a typer.Typer with that one command).
    # Imported only when the command runs or help lists it: a worker process that
    # imports nmbus.cli must not import the demo (and register its message types),
    # the embedded server or the benchmarks.
    lazy: ClassVar[dict[str, str]] = {
        "bench": "nmbus.cli.bench",
        "demo": "nmbus.cli.demo",
    }

    # Contexts and commands are click's (vendored by recent typer versions): Any here.
    def list_commands(self, ctx: Any) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in self.commands and cmd_name in self.lazy:
            module = importlib.import_module(self.lazy[cmd_name])
            self.commands[cmd_name] = typer.main.get_command(module.command)
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            plain_flags(command)
        return command

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        main = super().main
        return _main(
            self, main, args, prog_name, complete_var, standalone_mode, windows_expand_args, extra
        )


class NmbusCommand(TyperCommand):
    """One command run as a program of its own, with ``nmbus``'s one-line errors.

    For the repository's tools (``python -m bench``, ``python -m bench.soak``):
    ``@app.command(cls=NmbusCommand)`` on the one command of their typer app.
    """

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        main = super().main
        return _main(
            self, main, args, prog_name, complete_var, standalone_mode, windows_expand_args, extra
        )


def _main(
    command: Any,
    click_main: Callable[..., Any],
    args: Sequence[str] | None,
    prog_name: str | None,
    complete_var: str | None,
    standalone_mode: bool,
    windows_expand_args: bool,
    extra: dict[str, Any],
) -> Any:
    """``command``'s main: click's (``click_main``), every failure turned into one line."""
    if not standalone_mode:  # embedded in another program: it handles errors itself
        return click_main(args, prog_name, complete_var, False, windows_expand_args, **extra)
    options.reset()  # a fresh start for each invocation (tests invoke many in one process)
    plain_flags(command)
    try:
        result = click_main(args, prog_name, complete_var, False, windows_expand_args, **extra)
    except typer.Abort:
        print_error("aborted")
        sys.exit(1)
    except Exception as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # `nmbus`, `nmbus queues`: help
            if exc.format_message():  # type: ignore[attr-defined]  # else rich printed it
                exc.show()  # type: ignore[attr-defined]
            sys.exit(exc.exit_code)  # type: ignore[attr-defined]
        if _is_usage_error(exc):  # click's UsageError, BadParameter, ...: no traceback
            ctx = getattr(exc, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            print_error(exc.format_message() + hint)  # type: ignore[attr-defined]
            sys.exit(exc.exit_code)  # type: ignore[attr-defined]
        if options.debug:
            traceback.print_exception(exc)
        print_error(describe(exc))
        sys.exit(exc.code if isinstance(exc, CommandError) else _code(exc))
    # Without standalone mode, typer returns the code of a typer.Exit, or what
    # the command returned (None).
    sys.exit(result if isinstance(result, int) else 0)


def plain_flags(command: Any) -> None:
    """Help that reads well at 80 columns, for ``command`` and its subcommands.

    Some typer versions print a type for every option: ``--json <bool>`` for a
    flag (an empty metavar leaves it blank) and ``<int range>`` before the
    range itself (``<int> [x>=1]`` is enough).
    """
    params = list(command.params)
    helper = command.get_help_option(typer.Context(command))
    if helper is not None:
        params.append(helper)
    for param in params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
            continue
        described = getattr(param, "type_descriptor", None)
        if param.metavar is None and getattr(described, "is_ranged", False):
            param.metavar = f"<{described.ranged_type_name}>"  # type: ignore[union-attr]
    for sub in getattr(command, "commands", {}).values():
        plain_flags(sub)


def _is_usage_error(exc: Exception) -> bool:
    # click.ClickException, whether click is its own package or vendored by typer.
    return any(cls.__name__ == "ClickException" for cls in type(exc).__mro__)


def _code(exc: BaseException) -> int:
    """2 for wrong usage (docs/cli.md): an invalid setting, DSN or queue name; else 1."""
    if isinstance(exc, ValidationError) and exc.title == "Settings":
        return 2
    return 2 if isinstance(exc, InvalidSetting | InvalidQueueName) else 1


def describe(exc: BaseException) -> str:
    """One line that says what went wrong, for an operator (not a developer)."""
    if isinstance(exc, CommandError):
        return str(exc)
    if isinstance(exc, ValidationError):
        return _invalid_settings(exc)
    if isinstance(exc, NmbusError):
        return str(exc) or type(exc).__name__
    driver = driver_error_line(exc)
    if driver is not None:
        return driver
    return f"{type(exc).__name__}: {exc}"


def _invalid_settings(exc: ValidationError) -> str:
    if exc.title == "Settings":
        # The settings' own wording: it names each variable and never echoes a DSN
        # (routes and NMBUS_DB_<ALIAS> may hold passwords).
        from nmbus.settings import describe as describe_settings

        return describe_settings(exc)
    problems = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"])
        where = f"{field} (NMBUS_{field.upper()})" if exc.title == "Settings" else field
        value = error["input"]
        # Never echo a DSN back (it may hold a password), nor a whole dict of inputs.
        plain = isinstance(value, str | int | float | bool) and "dsn" not in field
        given = f", got {value!r}" if plain else ""
        problems.append(f"{where}: {error['msg']}{given}")
    return f"invalid setting {'; '.join(problems)}"
