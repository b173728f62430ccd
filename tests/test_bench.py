"""``nmbus bench`` and ``python -m bench`` run every mode on small numbers, print, and
leave no trace.

nmbus bench's modes run through the ``nmbus`` command and nmbus.bench.runner; the
repository's (peers, fanout, scaling, ...) through ``python -m bench`` and bench.modes.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import structlog
from typer.testing import CliRunner

from bench import cli as bench_cli
from bench import graphile as bench_graphile
from bench.modes import Options
from bench.modes import run as run_bench
from nmbus import Bus
from nmbus.bench.runner import BenchOptions, run
from nmbus.bench.saga import measure_contended
from nmbus.bench.scenarios import _check_single_write, measure_ceiling, percentile
from nmbus.bench.scratch import QUEUE, Scratch
from nmbus.bench.sql import render
from nmbus.cli import app
from tests.messages import Ping

ROOT = Path(__file__).resolve().parent.parent

SMALL = [
    "--messages",
    "300",
    "--batch-size",
    "50",
    "--baseline-messages",
    "40",
    "--rate",
    "100",
    "--seconds",
    "0.5",
    "--warmup",
    "0.1",
]
#: The fanout mode's options (python -m bench).
FANOUT = ["--fanout-messages", "60", "--publishers", "3"]


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    # The command configures structlog, as a CLI should; other tests must not see it.
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


async def _schemas(dsn: str) -> list[str]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'nmbus_bench%'"
        )
        return [r[0] for r in rows]
    finally:
        await conn.close()


def test_percentile_interpolates_between_ranks() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 100) == 100.0
    assert percentile([3.0], 95) == 3.0
    with pytest.raises(ValueError):
        percentile([], 50)


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m bench ARGS``, from the repository's root (bench/ is not installed)."""
    return subprocess.run(
        [sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_bench_all_prints_a_table_with_every_mode_and_its_settings(dsn: str) -> None:
    result = bench("all", "--dsn", dsn, *SMALL, *FANOUT)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for mode in ("ceiling", "peers", "drain", "transactional", "latency", "fanout"):
        assert mode in out
    for figure in (
        "crash_safe_messages_per_s",
        "ratio_to_ceiling",
        "ratio_to_crash_safe",
        "two_loops_ratio_to_crash_safe",
        "ratio_nmbus_to_best_pgqueuer",
        "ratio_to_per_message_tx",
        "ratio_no_outside_effects",
        "p99_ms",
        "p99_ratio_to_pgqueuer",
        "published_per_s",
        "load_average_1m",
    ):
        assert figure in out
    assert "batch_size=50" in out
    assert "load_average_1m=" in out
    assert asyncio.run(_schemas(dsn)) == []


def test_bench_json_gives_positive_figures_for_each_repeat(dsn: str) -> None:
    args = ["bench", "drain", "latency", "--dsn", dsn, "--repeat", "2", "--json", *SMALL]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = {r["mode"]: r for r in json.loads(result.output)}
    assert list(data) == ["drain", "latency"]
    drain = data["drain"]
    assert len(drain["runs"]["messages_per_s"]) == 2
    assert drain["figures"]["messages_per_s"] > 0
    assert drain["figures"]["ratio_to_ceiling"] > 0
    assert drain["settings"]["messages"] == 300
    latency = data["latency"]["figures"]
    assert 0 < latency["p50_ms"] <= latency["p95_ms"] <= latency["p99_ms"] <= latency["max_ms"]
    assert latency["samples"] == 50  # 100/s for 0.5 s counted, the 0.1 s warm-up not


def test_bench_rejects_an_unknown_mode_and_a_missing_dsn(monkeypatch: pytest.MonkeyPatch) -> None:
    # Usage errors (exit 2, one line) before anything connects: the DSN below is never used.
    monkeypatch.delenv("NMBUS_DSN", raising=False)
    result = CliRunner().invoke(app, ["bench", "drain"])
    assert (result.exit_code, result.stdout) == (2, ""), result.output
    assert result.stderr.splitlines() == [
        "error: Invalid value for --dsn: give --dsn or set NMBUS_DSN (see 'nmbus bench --help')"
    ]
    result = CliRunner().invoke(app, ["bench", "nonsense", "--dsn", "postgresql://x@127.0.0.1:1/x"])
    assert (result.exit_code, result.stdout) == (2, ""), result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: Invalid value: unknown mode 'nonsense'; choose from ceiling,")


def test_bench_peer_measures_only_the_peer_asked_for_and_refuses_an_unknown_one(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def not_asked(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("graphile-worker was not asked for")

    monkeypatch.setattr(bench_graphile, "measure_graphile", not_asked)
    args = ["peers", "--dsn", dsn, "--json", "--peer", "pgqueuer", *SMALL]
    result = CliRunner().invoke(bench_cli.app, args)
    assert result.exit_code == 0, result.output
    [peers] = json.loads(result.output)
    assert peers["settings"]["graphile_worker"] == "not asked for"
    assert peers["settings"]["pgqueuer"].startswith("1.")
    assert not any(name.startswith("graphile") for name in peers["figures"])
    assert peers["figures"]["ratio_nmbus_to_best_pgqueuer"] > 0
    assert not any("graphile" in note for note in peers["notes"])  # not "not installed"

    result = CliRunner().invoke(bench_cli.app, ["peers", "--dsn", dsn, "--peer", "rabbit"])
    assert (result.exit_code, result.stdout) == (2, ""), result.output
    (line,) = result.stderr.splitlines()
    assert "unknown peer 'rabbit'; choose from pgqueuer, graphile-worker" in line


async def test_xrows_compares_an_empty_and_a_loaded_table_and_explains_the_claim(
    dsn: str,
) -> None:
    options = BenchOptions(dsn=dsn, messages=200, batch_size=50, x_rows=3000)
    [result] = await run(["xrows"], options)
    assert result.figures["empty_messages_per_s"] > 0
    assert result.figures["with_x_rows_messages_per_s"] > 0
    plan = "\n".join(result.notes)
    assert "3000 X rows" in plan
    assert "Buffers" in plan and "Execution Time" in plan
    assert await _schemas(dsn) == []


async def test_delivery_measures_plain_priority_and_sequence_drains_in_one_run(
    dsn: str,
) -> None:
    options = Options(dsn=dsn, messages=300, batch_size=50, sequences=5, sequence_members=20)
    [result] = await run_bench(["delivery"], options)
    figures = result.figures
    for name in ("plain", "priority_mix", "sequences"):
        assert figures[f"{name}_messages_per_s"] > 0
    assert figures["priority_ratio_to_plain"] > 0
    assert figures["sequences_ratio_to_plain"] > 0
    assert result.settings["sequences"] == 5
    assert await _schemas(dsn) == []


async def test_the_bench_leaves_the_users_queues_alone(dsn: str, db: asyncpg.Connection) -> None:
    # A user's endpoint called "bench" in the default schema, with a message waiting.
    async with Bus("bench", dsn=dsn, concurrency=0) as bus:
        await bus.send(Ping(n=1), to="bench")
    options = BenchOptions(dsn=dsn, messages=100, batch_size=20)
    results = await run(["ceiling", "drain"], options)
    assert [r.mode for r in results] == ["ceiling", "drain"]
    rows = await db.fetch('SELECT subqueue, label FROM nmbus."bench"')
    assert [(r["subqueue"], r["label"]) for r in rows] == [("I", "test.Ping")]
    assert await _schemas(dsn) == []


async def test_fanout_with_one_publisher_stores_a_copy_per_subscriber(dsn: str) -> None:
    # One publisher once deadlocked: publish held the only pooled connection while
    # ensure_queue waited for another to look at a subscriber queue.
    options = Options(dsn=dsn, publishers=1, fanout_messages=20, fanout_batch=7, subscribers=2)
    [result] = await asyncio.wait_for(run_bench(["fanout"], options), timeout=60)
    published = result.figures["published_per_s"]
    assert result.figures["rows_per_s"] == pytest.approx(2 * published)
    batched = result.figures["batched_published_per_s"]
    assert result.figures["batched_rows_per_s"] == pytest.approx(2 * batched)
    assert result.settings["subscribers"] == 2


async def test_saga_compares_a_saga_with_the_same_handler_without(dsn: str) -> None:
    # The bench checks itself: every message counted once into one of 100 sagas.
    options = BenchOptions(dsn=dsn, messages=300, batch_size=50)
    [result] = await asyncio.wait_for(run(["saga"], options), timeout=120)
    figures = result.figures
    for name in ("saga_per_s", "plain_per_s", "hand_written_table_per_s"):
        assert figures[name] > 0
    assert figures["ratio_saga_to_plain"] == pytest.approx(
        figures["saga_per_s"] / figures["plain_per_s"]
    )
    assert result.settings["sagas"] == 100
    # The contended run: one process of one loop on three sagas, counted whole.
    assert figures["contended_per_s"] == pytest.approx(300 / figures["contended_wall_s"])
    assert figures["contended_messages_in_f"] == 0
    assert (result.settings["contended_processes"], result.settings["contended_sagas"]) == (1, 3)
    assert await _schemas(dsn) == []


async def test_the_contended_saga_run_analyzes_its_messages_before_any_claim(dsn: str) -> None:
    # Planned for the empty queue, the workers' claims read the whole table until
    # their own analyze, which claims of 50 never start: the run stores its messages
    # and analyzes the queue in one transaction, so the first claim plans for them.
    options = BenchOptions(dsn=dsn, messages=300, batch_size=50, sagas=3)
    async with Scratch(dsn) as scratch:
        figures = await measure_contended(options, scratch)
        await scratch.c.execute("SELECT pg_stat_clear_snapshot()")
        analyzed = await scratch.c.fetch(
            "SELECT relname, analyze_count, last_analyze FROM pg_stat_user_tables "
            "WHERE schemaname = $1 AND relname ~ $2",
            scratch.schema,
            rf"^{QUEUE}\$s[0-9]+$",  # its segments
        )
        # Each segment's first finish: its first claim came before it.
        first_done = [
            await scratch.c.fetchval(
                f"SELECT min(last_processed) FROM {_quoted(scratch.schema)}.{_quoted(name)}"
            )
            for name in (row["relname"] for row in analyzed)
        ]
    assert figures["contended_messages_in_f"] == 0
    assert analyzed and all(row["analyze_count"] == 1 for row in analyzed)
    assert all(
        row["last_analyze"] < done
        for row, done in zip(analyzed, first_done, strict=True)
        if done is not None
    )
    assert any(done is not None for done in first_done)


def _quoted(name: str) -> str:
    """An identifier quoted for SQL."""
    return '"' + name.replace('"', '""') + '"'


async def test_burst_drains_into_a_new_and_a_resting_queue_against_a_settled_one(
    dsn: str,
) -> None:
    # Each run checks itself: every message of the burst ends in X, once.
    options = Options(dsn=dsn, messages=300)
    [result] = await asyncio.wait_for(run_bench(["burst"], options), timeout=120)
    figures = result.figures
    for kind in ("settled", "new", "at_rest"):
        assert figures[f"{kind}_per_s"] > 0
    for kind in ("new", "at_rest"):
        assert figures[f"ratio_{kind}_to_settled"] == pytest.approx(
            figures[f"{kind}_per_s"] / figures["settled_per_s"]
        )
    assert result.settings["rest_rows"] == 50_000
    assert await _schemas(dsn) == []


async def test_scaling_drains_with_loops_and_processes_against_the_crash_safe_ceiling(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The machine's load is reported as read, after the run: a value no real
    # machine shows here tells it apart from a constant or a default.
    monkeypatch.setattr(os, "getloadavg", lambda: (7.25, 0.5, 0.25))
    options = Options(dsn=dsn, messages=300, batch_size=20)
    [result] = await asyncio.wait_for(run_bench(["scaling"], options), timeout=120)
    figures = result.figures
    for loops in (1, 2, 4):
        assert figures[f"crash_safe_{loops}_loops_per_s"] > 0
        assert figures[f"ratio_{loops}_loops"] == pytest.approx(
            figures[f"drain_{loops}_loops_per_s"] / figures[f"crash_safe_{loops}_loops_per_s"]
        )
    assert figures["drain_2_processes_per_s"] > 0
    assert figures["ratio_2_processes"] > 0
    assert figures["load_average_1m"] == 7.25
    assert await _schemas(dsn) == []


async def test_peers_runs_pgqueuer_in_the_bench_schema_beside_an_nmbus_drain(dsn: str) -> None:
    options = Options(dsn=dsn, messages=300, batch_size=50)
    [result] = await asyncio.wait_for(run_bench(["peers"], options), timeout=120)
    figures = result.figures
    best = max(figures["pgqueuer_batch_10_per_s"], figures["pgqueuer_batch_100_per_s"])
    assert figures["ratio_nmbus_to_best_pgqueuer"] == pytest.approx(
        figures["nmbus_messages_per_s"] / best
    )
    assert result.settings["pgqueuer"].startswith("1.")
    # pgqueuer's tables went into the scratch schema, and went with it.
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval("SELECT to_regclass('public.pgqueuer')") is None
    finally:
        await conn.close()
    assert await _schemas(dsn) == []


async def test_peers_runs_graphile_worker_at_both_settings_and_leaves_nothing(dsn: str) -> None:
    why = bench_graphile.missing()
    if why is not None:
        pytest.skip(why)  # CI installs it (.ci/run): there a skip fails the run
    options = Options(dsn=dsn, messages=2000, batch_size=50, peers=("graphile-worker",))
    [result] = await asyncio.wait_for(run_bench(["peers"], options), timeout=300)
    figures = result.figures
    assert not any(name.startswith("pgqueuer") for name in figures)  # not asked for
    assert result.settings["pgqueuer"] == "not asked for"
    assert figures["graphile_default_per_s"] > 0 and figures["graphile_tuned_per_s"] > 0
    assert figures["ratio_nmbus_to_graphile_tuned"] == pytest.approx(
        figures["nmbus_messages_per_s"] / figures["graphile_tuned_per_s"]
    )
    assert result.settings["graphile_worker"] == bench_graphile.VERSION
    assert not any("graphile" in note for note in result.notes)
    assert await _schemas(dsn) == []  # its schema (the scratch's name with _gw) is gone


async def test_peers_says_how_to_install_graphile_worker_and_downloads_nothing(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NMBUS_GRAPHILE_MODULES", str(tmp_path))
    assert bench_graphile.missing() is not None
    options = Options(dsn=dsn, messages=300, batch_size=50)
    [result] = await asyncio.wait_for(run_bench(["peers"], options), timeout=120)
    assert not any(name.startswith("graphile") for name in result.figures)
    (note,) = [n for n in result.notes if "graphile" in n]
    assert "npm install graphile-worker@0.17.3" in note or "node is not installed" in note
    assert result.settings["graphile_worker"] == "not installed"
    assert os.listdir(tmp_path) == []


async def test_reply_times_round_trips_and_reply_lag_of_every_request(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench import reply as bench_reply

    monkeypatch.setattr(bench_reply, "REQUESTS_50MS", 10)
    monkeypatch.setattr(bench_reply, "REQUESTS_CONCURRENT", 30)
    monkeypatch.setattr(bench_reply, "LONGEST", 0.2)
    options = Options(dsn=dsn)
    [result] = await asyncio.wait_for(run_bench(["reply"], options), timeout=120)
    figures = result.figures
    for scenario, count in (("slow_50ms", 10), ("concurrent", 30)):
        assert figures[f"{scenario}_requests"] == count
        assert 0 <= figures[f"{scenario}_answered_in_time"] <= count
        assert 0 < figures[f"{scenario}_p50_ms"] <= figures[f"{scenario}_p99_ms"]
        lag = figures[f"{scenario}_reply_lag_p50_ms"]
        assert 0 < lag <= figures[f"{scenario}_reply_lag_p99_ms"]
        # The lag is a part of the round trip.
        assert lag < figures[f"{scenario}_p99_ms"]
    assert result.settings["handler_concurrency"] == 20


async def test_flow_measures_concurrency_rate_and_the_claim_with_many_groups(dsn: str) -> None:
    [result] = await asyncio.wait_for(run_bench(["flow"], Options(dsn=dsn)), timeout=180)
    figures = result.figures
    assert figures["concurrency_most_running"] == figures["concurrency_limit"] == 5
    assert 0 < figures["concurrency_mean_running"] <= 5
    assert figures["rate_worst_one_second"] <= figures["rate_limit_per_s"] == 200
    assert figures["rate_achieved_per_s"] > 0
    assert figures["group_claim_ms"] > 0 and figures["plain_claim_ms"] > 0
    # The groups in turn: the 10 small ones end within the first batches, not after 100,000.
    assert 0 <= figures["fairness_big_before_last_small"] < 1_000
    assert figures["fairness_drain_per_s"] > 0
    assert result.settings["groups"] == 10_000
    assert await _schemas(dsn) == []


async def test_the_single_write_ceiling_writes_each_row_once_and_leaves_no_record(
    dsn: str,
) -> None:
    # Two loops over 1,000 rows in batches of 100: each row claimed by one batch,
    # its attempt counted once, and every batch's record gone with its commit.
    options = BenchOptions(dsn=dsn, messages=1_000, batch_size=100, concurrency=2)
    async with Scratch(dsn) as scratch:
        assert await measure_ceiling(options, scratch, single=True) > 0
        rows = await scratch.c.fetch(render("bench_attempts", scratch.schema, QUEUE))
        assert [tuple(r) for r in rows] == [("X", 1, 1_000)]
        assert await scratch.c.fetchval(render("bench_single_write_left", scratch.schema)) == 0


async def test_the_single_write_ceiling_fails_when_a_row_or_a_record_is_not_as_it_must_be(
    dsn: str,
) -> None:
    # Its own check, on what a broken loop would leave: rows never marked, and the
    # record of a batch that never finished.
    async with Scratch(dsn) as scratch:
        await scratch.create_queue()
        await scratch.preload(10)
        await scratch.c.execute(render("bench_single_write_create", scratch.schema))
        with pytest.raises(RuntimeError, match=r"left rows \[\('I', 0, 10\)\]"):
            await _check_single_write(scratch, 10)
        await scratch.c.execute(
            f"UPDATE {scratch.schema}.bench SET subqueue = 'X', retry_count = 1"
        )
        await _check_single_write(scratch, 10)
        await scratch.c.fetchval(render("bench_single_write_record", scratch.schema), 1, [1, 2])
        with pytest.raises(RuntimeError, match="and 1 records"):
            await _check_single_write(scratch, 10)
