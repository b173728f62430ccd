"""Every table of the command line at 80 columns and on a wide terminal.

No line is wider than the terminal, no name (queue, type) is broken or cut,
numbers are right-aligned, times are short. The renderer (nmbus.cli._table)
is checked on its own first, then through each command that prints a table.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import asyncpg
import pytest
import structlog
import typer
from rich.console import Console
from typer.testing import CliRunner, Result

from nmbus.cli import app
from nmbus.cli._common import seconds_text
from nmbus.cli._table import Column, Grid, age_text, short_time
from tests.ops_data import Facts, create_queue, insert, row, split_segments

runner = CliRunner()
WIDTHS = (80, 200)


@pytest.fixture(autouse=True)
def _keep_logging_config() -> Iterator[None]:
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def render(renderable: Any, width: int) -> str:
    console = Console(width=width, force_terminal=False, color_system=None)
    with console.capture() as captured:
        console.print(renderable)
    return captured.get()


def check_fits(text: str, width: int, names: Sequence[str] = ()) -> list[str]:
    """No line wider than ``width``; each of ``names`` whole on some line. Returns the lines."""
    lines = text.splitlines()
    too_wide = [line for line in lines if len(line) > width]
    assert not too_wide, f"wider than {width}:\n" + "\n".join(too_wide) + "\n\n" + text
    for name in names:
        assert any(re.search(rf"(^|\s){re.escape(name)}(\s|$)", line) for line in lines), (
            f"{name!r} is not whole on one line:\n{text}"
        )
    return lines


def _ends(line: str, token: str) -> set[int]:
    pattern = rf"(?<!\S){re.escape(token)}(?!\S)"
    return {m.end() for m in re.finditer(pattern, line)}


def right_aligned(lines: list[str], header_word: str, row_start: str, value: str) -> None:
    """In some table, ``value`` in the row starting with ``row_start`` ends under the header."""
    for i, line in enumerate(lines):
        for end in _ends(line, header_word):
            for below in lines[i + 1 :]:
                if not below.strip():
                    break  # the end of this table
                if below.startswith(row_start + " ") and end in _ends(below, value):
                    return
    raise AssertionError(f"{value!r} of {row_start!r} is not right-aligned under {header_word!r}")


def headers(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("queue ")]


# -- the renderer --------------------------------------------------------------------------------


def test_ages_and_durations_are_short() -> None:
    cases = {
        None: "-",
        0.25: "0.2s",
        4.0: "4s",
        42: "42s",
        200: "3m20s",
        1800: "30m",
        3900: "1h05m",
        86400 * 7: "7d",
        86400 * 2 + 3 * 3600 + 17: "2d03h",
        -90: "-1m30s",
    }
    assert {k: age_text(k) for k in cases} == cases
    assert age_text(timedelta(days=7)) == "7d"
    assert seconds_text(3900) == "1h05m" and seconds_text(None) == "-"


def test_times_are_short_and_local() -> None:
    now = datetime(2026, 11, 23, 15, 4, 5).astimezone()
    assert short_time(now - timedelta(hours=2), now) == (now - timedelta(hours=2)).strftime(
        "%H:%M:%S"
    )
    assert short_time(now.replace(month=2, day=3, hour=9, minute=7), now) == "02-03 09:07"
    assert short_time(now.replace(year=2025), now) == "2025-11-23"
    # An aware UTC time is shown in the local zone.
    utc = now.astimezone(UTC)
    assert short_time(utc, now) == now.strftime("%H:%M:%S")


def wide_grid() -> Grid:
    return Grid(
        "queues",
        [
            Column("queue", key=True),
            Column("I ready", group="rows"),
            Column("R scheduled", group="rows"),
            Column("X processed", group="rows"),
            Column("F failed", group="rows"),
            Column("oldest ready", align="right", group="rows"),
            Column("done 10m", group="recent"),
            Column("avg ms", align="right", group="recent"),
            Column("failed 10m", group="recent"),
        ],
        [
            ["notifications", 1234567, 3, 98765, 0, "3m20s", 1500, "12.5", 2],
            ["billing", 6, 0, 165, 3, "0.4s", 100, "-", 0],
        ],
    )


def test_a_table_that_fits_is_one_table_with_numbers_right_aligned() -> None:
    text = render(wide_grid(), 200)
    lines = check_fits(text, 200, ["notifications", "1,234,567", "98,765"])
    assert len(headers(lines)) == 1
    right_aligned(lines, "ready", "notifications", "1,234,567")
    right_aligned(lines, "ready", "billing", "6")
    right_aligned(lines, "processed", "billing", "165")
    right_aligned(lines, "10m", "notifications", "2")


def test_a_table_too_wide_splits_at_its_groups_and_repeats_the_key() -> None:
    text = render(wide_grid(), 80)
    lines = check_fits(text, 80, ["notifications", "billing", "1,234,567", "processed", "10m"])
    first, second = headers(lines)  # the subqueues, then the recent window
    assert "ready" in first and "done" in second and "ready" not in second
    assert sum(1 for line in lines if line.startswith("notifications")) == 2
    right_aligned(lines, "processed", "notifications", "98,765")
    right_aligned(lines, "10m", "billing", "0")


def test_when_even_a_split_does_not_fit_rows_are_stacked() -> None:
    long = "notifications_for_customers_in_europe"
    grid = wide_grid()
    grid = Grid(grid.title, grid.columns, [[long, *grid.raw[0][1:]], *grid.raw[1:]])
    text = render(grid, 46)
    lines = check_fits(text, 46, [long, "billing", "processed"])
    assert long in lines and "billing" in lines  # each row's key on a line of its own
    assert any(re.fullmatch(r"\s+X processed\s+98,765\s*", line) for line in lines), text
    assert any(re.fullmatch(r"\s+avg ms\s+12.5\s*", line) for line in lines), text


def test_rows_their_keys_cannot_tell_apart_are_stacked_not_split() -> None:
    grid = wide_grid()
    twice = Grid(grid.title, grid.columns, [grid.raw[0], grid.raw[0]])
    assert wide_grid().parts(80) is not None and twice.parts(80) is None
    lines = check_fits(render(twice, 80), 80, ["notifications"])
    assert lines.count("notifications") == 2 and not headers(lines)
    unsplit = Grid(grid.title, grid.columns, grid.raw, split=False)
    assert unsplit.parts(200) is not None and unsplit.parts(80) is None


def test_free_text_wraps_between_words_and_names_stay_whole() -> None:
    error = "SMTPServerDisconnected: connection unexpectedly closed by mail.example.com"
    grid = Grid(
        None,
        [Column("queue", key=True), "type", Column("error", wrap=True)],
        [["notifications", "shop.OrderConfirmationRequested", error]],
    )
    text = render(grid, 80)
    check_fits(text, 80, ["notifications", "shop.OrderConfirmationRequested", "mail.example.com"])
    assert "SMTPServerDisconnected:" in text and "unexpectedly" in text
    assert error not in text.replace("\n", " ")  # it did wrap ...
    words = re.sub(r"\s+", " ", text).split(" ")
    assert all(w in words for w in error.split())  # ... between words


def test_cells_are_text_not_markup_and_empty_tables_say_so() -> None:
    text = render(Grid("t", ["a"], [["[red]x[/red] [bold]"]]), 80)
    assert "[red]x[/red] [bold]" in text
    empty = render(Grid("failed messages", ["queue"], [], empty="no failed messages"), 80)
    assert empty == "no failed messages\n"


# -- the commands ---------------------------------------------------------------------------------


async def invoke(width: int, *argv: str, command: typer.Typer = app) -> Result:
    env = {"COLUMNS": str(width), "NMBUS_DSN": None}
    result = await asyncio.to_thread(runner.invoke, command, list(argv), env=env)
    assert result.exit_code == 0, (argv, result.output, result.exception)
    return result


@pytest.mark.parametrize("width", WIDTHS)
async def test_status(dsn: str, facts: Facts, width: int) -> None:
    lines = check_fits(
        (await invoke(width, "status", "--dsn", dsn)).stdout, width, ["billing", "shipping"]
    )
    right_aligned(lines, "processed", "billing", "165")
    right_aligned(lines, "failed", "billing", "3")
    right_aligned(lines, "10m", "billing", "100")  # done 10m
    right_aligned(lines, "ms", "billing", "99.0")  # p99 ms
    assert any(re.search(r"\s3[01]m(\d\ds)?(\s|$)", line) for line in lines)  # oldest ready
    assert len(headers(lines)) == (1 if width == 200 else 2)


@pytest.mark.parametrize("width", WIDTHS)
async def test_failed_list(dsn: str, facts: Facts, width: int) -> None:
    text = (await invoke(width, "failed", "list", "--dsn", dsn)).stdout
    lines = check_fits(text, width, ["billing", "billing.Charge", "billing.Refund"])
    assert "ValueError: card declined" in text and "KeyError: 'refund_id'" in text
    right_aligned(lines, "attempts", "billing", "5")
    right_aligned(lines, "id", "billing", str(facts.failed_ids[0]))
    # Failed 30 to 50 minutes ago: a short time, never microseconds and offsets.
    assert "+00:00" not in text and not re.search(r"\d{2}:\d{2}:\d{2}\.\d", text)
    assert re.search(r"\s(\d\d:\d\d:\d\d|\d\d-\d\d \d\d:\d\d)\s", text), text


@pytest.mark.parametrize("width", WIDTHS)
async def test_subscriptions_queues_and_cleanup(
    dsn: str, db: asyncpg.Connection, facts: Facts, width: int
) -> None:
    await split_segments(db, "subqueue = 'X' AND last_processed < now() - interval '12 hours'")
    text = (await invoke(width, "subscriptions", "list", "--dsn", dsn)).stdout
    check_fits(text, width, ["orders.OrderCancelled", "payments.Refunded", "shipping", "expired"])
    narrow = (await invoke(50, "subscriptions", "list", "--dsn", dsn)).stdout
    lines = check_fits(narrow, 50, ["orders.OrderCancelled", "expired"])
    assert "orders  orders.OrderPlaced  audit" in lines  # one block per subscription
    assert "+00:00" not in text
    text = (await invoke(width, "queues", "list", "--dsn", dsn)).stdout
    check_fits(text, width, ["billing", "shipping"])
    text = (await invoke(width, "cleanup", "--older-than", "12h", "--dry-run", "--dsn", dsn)).stdout
    lines = check_fits(text, width, ["billing", "shipping", "12h"])
    right_aligned(lines, "processed", "billing", "65")


async def test_failed_show_keeps_every_value_whole(dsn: str, facts: Facts) -> None:
    text = (
        await invoke(80, "failed", "show", "billing", str(facts.failed_ids[0]), "--dsn", dsn)
    ).stdout
    check_fits(text, 80, ["billing.Charge", '{"tenant": "acme"}'])
    assert re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+\+00:00", text)  # full timestamps


LONG_QUEUE = "notifications_for_customers_in_europe"
LONG_TYPE = "shop.notifications.OrderConfirmationEmailRequested"


@pytest.mark.parametrize("width", WIDTHS)
async def test_long_names_stay_whole(
    dsn: str, db: asyncpg.Connection, facts: Facts, width: int
) -> None:
    await create_queue(db, LONG_QUEUE)
    when = datetime.now(UTC) - timedelta(days=3)
    error = "SMTPServerDisconnected: connection unexpectedly closed by mail.example.com"
    failed = row(
        "F",
        last_processed=when,
        retry_time=when,
        retry_count=12,
        error_info=error,
        label=LONG_TYPE,
        queue=LONG_QUEUE,
    )
    await insert(db, LONG_QUEUE, [failed])
    text = (await invoke(width, "status", "--dsn", dsn)).stdout
    header_words = [
        "ready",
        "scheduled",
        "processed",
        "failed",
        "flight",
        "oldest",
        "done",
        "avg",
        "p99",
        "ms",
    ]
    check_fits(text, width, [LONG_QUEUE, "billing", *header_words])
    text = (await invoke(width, "failed", "list", "--dsn", dsn)).stdout
    check_fits(text, width, [LONG_QUEUE, LONG_TYPE, "billing.Refund", "mail.example.com"])
    assert "12" in text and when.astimezone().strftime("%m-%d %H:%M") in text


async def test_status_window_is_an_age_and_bad_values_are_usage_errors(
    dsn: str, facts: Facts
) -> None:
    result = await invoke(200, "status", "--window", "1h", "--dsn", dsn)
    assert "(recent = last 1h)" in result.stdout and "failed 1h" in result.stdout
    # failed 1h, then the segments: how many, the oldest row, their size
    assert re.search(r"^billing .* 3 +\d+ +\S+( \S+)? +[\d.]+ KiB$", result.stdout, re.MULTILINE), (
        result.stdout
    )
    env = {"COLUMNS": "80", "NMBUS_DSN": None}
    for argv in (
        ["status", "--window", "-5"],
        ["status", "--window", "0"],
        ["status", "--window", "nan"],
        ["status", "--window", "1e300"],
        ["failed", "list", "--limit", "0"],
    ):
        bad = await asyncio.to_thread(runner.invoke, app, [*argv, "--dsn", dsn], env=env)
        assert bad.exit_code == 2, (argv, bad.output)
        assert bad.stderr.startswith("error: ") and len(bad.stderr.splitlines()) == 1


async def test_empty_listings_say_so(dsn: str) -> None:
    result = await invoke(80, "failed", "list", "--dsn", dsn)
    assert result.stdout == "no failed messages\n"
    async with asyncpg.create_pool(dsn, min_size=1, max_size=1) as pool, pool.acquire() as db:
        await create_queue(db, "billing")
    result = await invoke(80, "failed", "list", "billing", "--dsn", dsn)
    assert result.stdout == "no failed messages in billing\n"
    result = await invoke(80, "subscriptions", "list", "--dsn", dsn)
    assert result.stdout == "no subscriptions\n"


async def test_cleanup_dry_run_says_ages_as_people_do(dsn: str, facts: Facts) -> None:
    text = (await invoke(200, "cleanup", "--dry-run", "--dsn", dsn)).stdout
    assert "older than 7d" in text and "days," not in text and "0:00:00" not in text
    text = (
        await invoke(200, "cleanup", "--dry-run", "--failed-older-than", "90m", "--dsn", dsn)
    ).stdout
    assert "failed rows older than 1h30m" in text


# -- the demo's and the report's tables ---------------------------------------------------------


def demo_summary() -> dict[str, Any]:
    def queue(name: str, processed: int, failed: int) -> dict[str, Any]:
        latency = {"p50": 12.3456, "p95": 1234.5, "p99": 98765.4321, "max": 123456.7}
        return {
            "queue": name,
            "processed": processed,
            "failed": failed,
            "failure_rate": failed / (processed + failed),
            "queue_latency_ms": latency,
        }

    queues = [queue("billing", 2900, 100), queue("warehouse", 2900, 0)]
    queues.append(queue("notifications", 5800, 3))
    overall = {k: v for k, v in queue("all", 11600, 103).items() if k != "queue"}
    return {"window": "second", "queues": queues, "overall": overall}


@pytest.mark.parametrize("width", WIDTHS)
def test_demo_tables(width: int) -> None:
    from nmbus.cli import demo as demo_cli
    from nmbus.demo.services import QueueCounts, Snapshot

    snap = Snapshot(
        orders=3000,
        published=3000,
        queues=[
            QueueCounts("billing", 0, 12, 2900, 100),
            QueueCounts("warehouse", 3, 0, 2900, 0),
            QueueCounts("notifications", 1, 2, 5800, 3),
        ],
        elapsed=12.0,
        attempts_failed=359,
        declined=100,
    )
    lines = check_fits(render(demo_cli.queue_table(snap), width), width, ["notifications"])
    right_aligned(lines, "(X)", "notifications", "5,800")
    right_aligned(lines, "second", "notifications", "483")
    text = render(demo_cli.report_table(demo_summary()), width)
    lines = check_fits(text, width, ["notifications", "warehouse", "all", "98,765.4"])
    right_aligned(lines, "processed", "notifications", "5,800")
    right_aligned(lines, "rate", "billing", "3.33%")


def test_demo_summary_says_what_became_of_failed_attempts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from nmbus.cli import demo as demo_cli
    from nmbus.demo.services import BusResult, QueueCounts, Snapshot

    snap = Snapshot(
        orders=3000,
        published=3000,
        queues=[QueueCounts("billing", 0, 0, 2900, 102)],
        elapsed=12.0,
        attempts_failed=359,
        declined=100,
        attempts_retried=357,
    )
    demo_cli._print_bus(BusResult(snap, payments=2900, retried={}, top_errors=[], seconds=10.0))
    text = " ".join(capsys.readouterr().out.split())
    assert "359 handler attempts failed and 357 of them were retried." in text
    # What F holds adds up: the declined cards and the 2 last attempts.
    assert (
        "F holds 102 messages: 100 declined cards (a PermanentError is never retried) "
        "and 2 messages whose last attempt failed." in text
    )


@pytest.mark.parametrize("width", WIDTHS)
def test_report_summary_table(
    width: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from nmbus.cli.report import _print_summary

    monkeypatch.setenv("COLUMNS", str(width))
    result = SimpleNamespace(
        summary=demo_summary(),
        rows=11703,
        seconds=4.2,
        html_path="nmbus-report/report.html",
        json_path="nmbus-report/summary.json",
        out="nmbus-report",
    )
    _print_summary(result)
    lines = check_fits(capsys.readouterr().out, width, ["notifications", "123,456.7"])
    right_aligned(lines, "failed", "billing", "100")


# -- the tools' tables: figures of a short benchmark and of a short soak (bench.soak) --------------


async def test_bench_tables_at_80_columns(dsn: str) -> None:
    argv = ["bench", "ceiling", "drain", "-n", "300", "--batch-size", "50", "--dsn", dsn]
    lines = check_fits((await invoke(80, *argv)).stdout, 80, ["ceiling", "messages_per_s"])
    assert any(line.startswith("drain ") and "ratio_to_ceiling" in line for line in lines)
    # The settings wrap between items, each item whole.
    text = "\n".join(lines)
    assert re.search(r"(?<!\S)batch_size=50,", text) and re.search(r"(?<!\S)messages=300,", text)


@pytest.mark.timeout(120)
async def test_soak_table_at_80_columns(dsn: str) -> None:
    from bench.soak.cli import app as soak

    argv = ["--messages", "100", "--workers", "1", "--kill-every", "1", "--dsn", dsn]
    lines = check_fits((await invoke(80, *argv, command=soak)).stdout, 80, ["processed", "lost"])
    right_aligned(lines, "value", "processed", "100")
    right_aligned(lines, "value", "lost", "0")
