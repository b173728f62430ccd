"""The help of every command: every option described, readable at 80 columns."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from typer.testing import CliRunner, Result

from nmbus.cli import app

runner = CliRunner()


def invoke(*argv: str, width: int = 80) -> Result:
    return runner.invoke(app, list(argv), env={"COLUMNS": str(width), "NMBUS_DSN": None})


def commands() -> Iterator[tuple[list[str], Any]]:
    """Every command and group, lazy ones included, with its path of names."""

    def walk(command: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
        yield path, command
        ctx = typer.Context(command)
        for name in getattr(command, "list_commands", lambda _ctx: [])(ctx):
            yield from walk(command.get_command(ctx, name), [*path, name])

    yield from walk(typer.main.get_command(app), [])


PATHS = [" ".join(path) for path, _ in commands()]


def test_the_walk_finds_every_command() -> None:
    for expected in ("", "status", "failed list", "queues ddl", "bench", "demo", "report"):
        assert expected in PATHS


def test_every_option_and_argument_has_a_description() -> None:
    missing = [
        f"nmbus {' '.join(path)} {param.name}"
        for path, command in commands()
        for param in command.params
        if not (getattr(param, "help", None) or "").strip()
    ]
    assert not missing, f"no help text: {missing}"


@pytest.mark.parametrize("path", PATHS)
def test_help_reads_well_at_80_columns(path: str) -> None:
    result = invoke(*path.split(), "--help")
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert text.strip(), path
    wide = [line for line in text.splitlines() if len(line) > 80]
    assert not wide, "\n".join(wide)
    assert "…" not in text, text  # an option name or a word cut short
    # Flags are flags (`--json`, not `--json <bool>`); a range shows once.
    assert "<bool>" not in text and "range>" not in text, text
    for line in text.splitlines():
        if re.search(r"--(json|yes|help|all|dry-run|debug|live)\b", line):
            assert "<" not in line.split("--", 1)[1].split("  ")[0], line


GROUPS = [" ".join(path) for path, command in commands() if hasattr(command, "list_commands")]


@pytest.mark.parametrize("path", GROUPS)
def test_each_command_is_summed_up_on_one_line(path: str) -> None:
    # Wide enough for any summary: a second line is a break in mid-sentence.
    text = invoke(*path.split(), "--help", width=250).stdout
    box = text.split("─ Commands ─", 1)[1].split("╰", 1)[0].splitlines()[1:]
    rows = [line.strip("│ ") for line in box]
    assert rows and all(re.match(r"[a-z-]+ {2,}\S", row) for row in rows), "\n".join(box)


def test_version_flag_and_command_agree() -> None:
    flag, command = invoke("--version"), invoke("version")
    assert flag.exit_code == command.exit_code == 0, (flag.output, command.output)
    assert flag.stdout == command.stdout
    assert re.fullmatch(r"\S+\n", flag.stdout), flag.stdout


def test_help_texts_that_used_to_puzzle() -> None:
    report = re.sub(r"[\s│]+", " ", invoke("report", "--help", width=200).stdout)
    assert "rank error n/A" not in report and "ceil(n/A) + 1 ranks" in report
    bench = re.sub(r"[\s│]+", " ", invoke("bench", "--help", width=200).stdout)
    assert re.search(r"--messages -n <int> \[x>=1\] messages pre-loaded and drained", bench)
    assert re.search(r"--batch-size <int> \[1<=x<=10000\] rows a worker claims", bench)
