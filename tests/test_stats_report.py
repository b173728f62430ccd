"""`nmbus report`'s defaults and page logic that need no Spark: window choice,
the cards, the progress line, where the JVM's output goes, a missing database,
and the demo's count of retried attempts."""

from __future__ import annotations

import io
import math
import os
import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from nmbus.stats import report_html
from nmbus.stats.aggregate import MAX_POINTS, choose_window
from nmbus.stats.options import WINDOWS
from nmbus.stats.progress import Progress, jvm_output_to, stage_text

T0 = datetime(2024, 3, 1, 9, 40, tzinfo=UTC)


@pytest.mark.parametrize(
    ("span", "window"),
    [
        (timedelta(0), "second"),
        (timedelta(seconds=45), "second"),  # the demo: one short run
        (timedelta(minutes=5), "second"),
        (timedelta(minutes=6), "minute"),
        (timedelta(hours=5), "minute"),
        (timedelta(hours=24), "hour"),
        (timedelta(days=12), "hour"),
        (timedelta(days=13), "day"),
        (timedelta(days=5000), "day"),
    ],
)
def test_window_is_chosen_from_the_time_span(span: timedelta, window: str) -> None:
    assert choose_window(T0, T0 + span) == window
    # The smallest window that draws the span in at most MAX_POINTS points.
    points = span.total_seconds() / WINDOWS[window]
    assert points <= MAX_POINTS or window == "day"
    smaller = [w for w in WINDOWS if WINDOWS[w] < WINDOWS[window]]
    assert all(span.total_seconds() / WINDOWS[w] > MAX_POINTS for w in smaller)


def test_no_rows_keeps_the_hour() -> None:
    assert choose_window(None, None) == "hour"


def _metrics(processed: int, failed: int) -> dict[str, Any]:
    total = processed + failed
    lat = {"rows": processed, "mean": 5.0, "p50": 4.0, "p95": 9.0, "p99": 12.0, "max": 20.0}
    return {
        "processed": processed,
        "failed": failed,
        "total": total,
        "failure_rate": failed / total if total else None,
        "throughput_per_s": 2.0,
        "queue_latency_ms": dict(lat),
        "e2e_latency_ms": dict(lat),
        "first_time": "2024-03-01T09:40:00Z",
        "last_time": "2024-03-01T10:40:00Z",
    }


def summary(queues: dict[str, tuple[int, int]], errors: list[dict[str, Any]]) -> dict[str, Any]:
    qs = [
        {
            "queue": name,
            **_metrics(*counts),
            "labels": [],
            "retries": [
                {
                    "label": "a.B",
                    "outcome": "processed",
                    "retry_count": 1,
                    "messages": counts[0],
                    "deferred": 1,
                }
            ],
            "top_errors": [e for e in errors if e["queue"] == name],
            "windows": [],
        }
        for name, counts in queues.items()
    ]
    processed = sum(c[0] for c in queues.values())
    failed = sum(c[1] for c in queues.values())
    return {
        "title": "nmbus report",
        "generated_at": "2024-03-01T11:00:00Z",
        "source": {"database": "db:5432/app", "schema": "nmbus", "queues": list(queues)},
        "window": "minute",
        "window_seconds": 60,
        "window_chosen": "from the data's time span",
        "since": None,
        "until": None,
        "percentiles": {"accuracy": 10000, "rank_error": "ceil(n/10000) + 1"},
        "overall": _metrics(processed, failed),
        "queues": qs,
        "top_errors": errors,
    }


def error(queue: str, text: str, failed: int, recovered: int) -> dict[str, Any]:
    return {
        "queue": queue,
        "label": "a.B",
        "error": text,
        "failed": failed,
        "recovered": recovered,
        "example_id": 7,
        "example": text.replace("<n>", "42"),
    }


def card(page: str, title: str) -> str:
    m = re.search(
        rf'<div class="card ([a-z]*)"><div class="k">{title}</div>'
        r'<div class="v">([^<]*)</div><div class="s">([^<]*)</div>',
        page,
    )
    assert m, title
    return " | ".join(m.groups())


def test_top_error_card_does_not_name_an_error_whose_messages_all_recovered() -> None:
    # Sorted as the job sorts (failed, then recovered): the first row recovered entirely.
    errs = [
        error("orders", "TimeoutError: slow <n>", 0, 900),
        error("orders", "KeyError: 'customer_id'", 3, 1),
    ]
    page = report_html.render(summary({"orders": (1000, 3)}, errs))
    assert card(page, "Top error") == "failing | 3 failed | KeyError: &#x27;customer_id&#x27;"

    only_recovered = [error("orders", "TimeoutError: slow <n>", 0, 900)]
    page = report_html.render(summary({"orders": (1000, 0)}, only_recovered))
    got = card(page, "Top error")
    assert "TimeoutError" not in got
    assert got == "ok | none | 900 errored, all recovered"


def test_failed_card_takes_the_colour_of_the_banner() -> None:
    # 1 % overall is "degraded" at most, but one queue fails 10 %: the banner says so.
    s = summary({"billing": (90, 10), "mail": (2000, 0), "orders": (2000, 0)}, [])
    page = report_html.render(s)
    assert re.search(r'<span class="verdict failing">1 of 3 queue\(s\) need attention', page)
    assert card(page, "Failed").startswith("failing | 10 |")
    # Nothing failed: the card is green whatever else happens.
    page = report_html.render(summary({"orders": (2000, 0)}, []))
    assert card(page, "Failed").startswith("ok | 0 |")


def test_header_times_are_utc_to_the_second_and_thresholds_are_stated() -> None:
    s = summary({"orders": (10, 0)}, [])
    s["generated_at"] = "2024-03-01T11:00:00.654321Z"
    s["overall"]["first_time"] = "2024-03-01T09:40:00.123456Z"
    s["overall"]["last_time"] = "2024-03-01T11:40:59.999999+01:00"  # another zone: to UTC
    page = report_html.render(s)
    header = page[page.index("<header>") : page.index("</header>")]
    assert "2024-03-01 09:40:00 → 2024-03-01 10:40:59 UTC" in header, header
    assert "generated 2024-03-01 11:00:00 UTC" in header, header
    assert not re.search(r"\d{2}:\d{2}:\d{2}\.\d|T\d{2}:", header), header
    assert "1% or more of its messages fail (degraded), 5% or more (failing)" in header, header
    # A range asked for (--since/--until) is shown the same way.
    s["since"], s["until"] = "2024-03-01T00:00:00Z", "2024-03-02T00:00:00.5Z"
    page = report_html.render(s)
    assert "2024-03-01 00:00:00 → 2024-03-02 00:00:00 UTC" in page


def bar_widths(page: str) -> dict[str, float]:
    """Each queue's failure-rate bar width, in percent, as the page draws it."""
    rows = re.findall(
        r'<tr><td><span class="dot [a-z]+" title="[a-z]+"></span>([^<]+)</td>.*?'
        r'<span class="bar"><i class="[a-z]+" style="width:([\d.]+)%"></i></span>',
        page,
    )
    return {queue: float(width) for queue, width in rows}


def test_failure_bars_tell_queues_apart_from_a_hundredth_of_a_percent_to_all() -> None:
    # 0.03 %, 2.27 % and 100 %: a bar full at 0.1 % drew the last two the same.
    s = summary(
        {"quiet": (10_000, 0), "rare": (99_970, 30), "often": (9_773, 227), "all": (0, 50)}, []
    )
    widths = bar_widths(report_html.render(s))
    assert set(widths) == {"quiet", "rare", "often", "all"}, widths
    assert widths["quiet"] == 0.0 and widths["all"] == 100.0
    assert 0 < widths["rare"] < widths["often"] < widths["all"]
    # A tenfold is a quarter of the bar, whatever the rate: comparable across reports.
    assert widths["often"] - widths["rare"] == pytest.approx(25 * math.log10(2.27 / 0.03), abs=0.2)
    assert report_html.failure_bar(0.001) == pytest.approx(25.0)
    assert report_html.failure_bar(0.1) == pytest.approx(75.0)
    assert report_html.failure_bar(1e-7) == report_html.BAR_SLIVER  # seen, never nothing
    assert "log scale" in report_html.render(s)


def test_window_reads_as_a_sentence() -> None:
    s = summary({"orders": (10, 0)}, [])
    page = report_html.render(s)
    assert "one point per minute (from the data&#x27;s time span)" in page
    assert "window minute" not in page
    s.pop("window_chosen")
    s["window"] = "second"
    assert "· one point per second ·" in report_html.render(s)


# ------------------------------------------------------------------ progress and output


class FakeStage:
    def __init__(self, done: int, total: int) -> None:
        self.numCompletedTasks = done
        self.numTasks = total


class FakeTracker:
    def getActiveStageIds(self) -> list[int]:
        return [7, 3]

    def getStageInfo(self, stage_id: int) -> FakeStage | None:
        return {3: FakeStage(5, 8), 7: FakeStage(0, 2)}.get(stage_id)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_names_stages_and_tasks() -> None:
    assert stage_text(FakeTracker()) == "stage 3: 5/8 tasks, stage 7: 0/2 tasks"
    progress = Progress(stream=Terminal())
    assert re.fullmatch(r"Spark: \d+\.\ds · starting", progress.line())
    progress.tracker = FakeTracker()
    assert re.fullmatch(
        r"Spark: \d+\.\ds · stage 3: 5/8 tasks, stage 7: 0/2 tasks", progress.line()
    )


def test_progress_updates_on_a_terminal_and_erases_itself() -> None:
    term = Terminal()
    with Progress(stream=term, interval=0.01) as progress:
        progress.tracker = FakeTracker()
        while "stage 3" not in term.getvalue():
            pass
    out = term.getvalue()
    assert out.count("\rSpark: ") >= 1
    assert out.endswith("\r")  # the line is blanked at the end


def test_progress_is_silent_when_not_a_terminal() -> None:
    stream = io.StringIO()
    with Progress(stream=stream, interval=0.01) as progress:
        progress.tracker = FakeTracker()
        assert progress._thread is None
    assert stream.getvalue() == ""


def test_jvm_output_goes_to_the_log_file(tmp_path: Path) -> None:
    # A child started inside inherits the file for good, as the JVM does; the
    # parent's own descriptors are back afterwards.
    script = (
        "import subprocess, sys\n"
        "from nmbus.stats.progress import jvm_output_to\n"
        f"with jvm_output_to({str(tmp_path / 'logs' / 'spark.log')!r}):\n"
        "    child = subprocess.Popen(['sh', '-c', 'sleep 0.2; echo jvm-warning >&2; "
        "echo jvm-out'])\n"
        "print('after', flush=True)\n"
        "print('after-err', file=sys.stderr, flush=True)\n"
        "child.wait()\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "after\n"
    assert proc.stderr == "after-err\n"
    log = (tmp_path / "logs" / "spark.log").read_text()
    assert "jvm-warning" in log and "jvm-out" in log


def test_jvm_output_to_restores_descriptors_after_an_error(tmp_path: Path) -> None:
    before = os.fstat(2)
    with pytest.raises(RuntimeError), jvm_output_to(str(tmp_path / "x.log")):
        raise RuntimeError("JVM failed to start")
    after = os.fstat(2)
    assert (before.st_ino, before.st_dev) == (after.st_ino, after.st_dev)


# ------------------------------------------------------------------ the command


def test_report_on_a_database_that_does_not_exist_is_one_line(dsn: str, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from nmbus.cli import app

    bad = re.sub(r"/[^/?]+(\?|$)", r"/no_such_database_for_report\1", dsn)
    res = CliRunner().invoke(app, ["report", "--dsn", bad, "--out", str(tmp_path / "r")])
    assert res.exit_code == 2  # as every failure of the statistics job (docs/cli.md)
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1, res.output
    assert 'database "no_such_database_for_report" does not exist' in lines[0]
    # Refused before Spark: nothing started, no log written.
    assert "starting Spark" not in res.output
    assert not (tmp_path / "r" / "spark.log").exists()


def test_demo_counts_retried_attempts_apart_from_last_ones() -> None:
    from nmbus.demo.services import Chaos, DemoOptions

    chaos = Chaos(DemoOptions(flaky_rate=1.0, max_attempts=3))
    assert chaos.flaky("billing", 1, 1) and chaos.flaky("billing", 1, 2)
    assert chaos.flaky("billing", 1, 3)  # the last attempt fails: to F, not retried
    assert (chaos.attempts_failed, chaos.attempts_retried) == (3, 2)
