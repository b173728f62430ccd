"""Worker metrics: ``/metrics`` of a running worker, parsed by prometheus_client's parser.

Every count is checked against messages whose fate is known in advance: some
handled, some retried then failed, one of a type nobody defines (F).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nmbus import Bus, Context, Message
from nmbus.consume import worker as worker_module
from nmbus.errors import ConfigurationError, InvalidSetting
from nmbus.messages import Envelope
from nmbus.settings import Settings
from tests.messages import Ping
from tests.waits import wait_until


class Good(Message, type_name="obs.Good"):
    n: int


class Bad(Message, type_name="obs.Bad"):
    n: int


class Slow(Message, type_name="obs.Slow"):
    seconds: float


ROOT = Path(__file__).resolve().parent.parent
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        body: bytes = response.read()
        return body.decode()


def samples(text: str) -> Samples:
    """Every sample of an exposition, by (name, sorted labels)."""
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(found: Samples, name: str, **labels: str) -> float:
    """One sample's value; a sample that is not exposed at all fails the test."""
    key = (name, tuple(sorted(labels.items())))
    if key not in found:
        raise AssertionError(f"no sample {name}{labels} in the exposition")
    return found[key]


def unmoved(found: Samples, name: str, **labels: str) -> float:
    """A count that must not have moved: its series absent or at 0, its family exposed."""
    assert any(n == name for n, _ in found), f"no {name} series at all"
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


def documented_worker_series() -> list[tuple[str, str]]:
    """(series, type) of every row of the worker table in docs/metrics.md."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    table = text.split("| series | type | labels | what it counts |", 1)[1]
    rows = re.findall(r"^\| `(nmbus_[a-z_]+)` \| (counter|histogram|gauge) \|", table, re.M)
    assert rows, "docs/metrics.md has no worker series table"
    return rows


async def wait_rows(db: asyncpg.Connection, queue: str, expected: dict[str, int]) -> None:
    query = f"SELECT subqueue, count(*) FROM nmbus.{queue} GROUP BY subqueue"

    async def counts() -> dict[str, int]:
        return {r[0].strip(): r[1] for r in await db.fetch(query)}

    await wait_until(counts, until=lambda found: found == expected, timeout=60)


async def test_running_worker_serves_the_documented_series(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("metered", metrics_port=0, retry_delay=0.0, max_attempts=2, batch_size=3)

    @bus.handler
    async def good(msg: Good, ctx: Context) -> None:
        pass

    @bus.handler
    async def bad(msg: Bad, ctx: Context) -> None:
        raise ValueError(f"bad {msg.n}")

    assert bus.metrics_port is None  # not serving before start
    async with bus:
        port = bus.metrics_port
        assert port is not None and port > 0
        for n in range(5):
            await bus.send(Good(n=n), to="metered")
        for n in range(2):
            await bus.send(Bad(n=n), to="metered")
        # A label no class defines: F, counted under "(unknown)" rather than a new series.
        made_up = Envelope("made.up.Type", "{}", None, "made-up-1", None, None)
        await bus.store.insert("metered", "elsewhere", [made_up])
        await wait_rows(db, "metered", {"X": 5, "F": 3})
        # The counters move after the commit the rows above show: wait for the last batch.
        await wait_until(
            lambda: sum(bus.worker.outcomes[s] for s in "XRF"),
            until=lambda n: n >= 10,
            interval=0.01,
        )
        text = await asyncio.to_thread(scrape, port)
    found = samples(text)
    q = {"queue": "metered"}
    assert value(found, "nmbus_messages_handled_total", type="obs.Good", **q) == 5
    assert value(found, "nmbus_messages_failed_total", type="obs.Bad", **q) == 2
    assert value(found, "nmbus_messages_retried_total", type="obs.Bad", **q) == 2
    assert value(found, "nmbus_messages_failed_total", type="(unknown)", **q) == 1
    assert unmoved(found, "nmbus_messages_handled_total", type="obs.Bad", **q) == 0
    assert unmoved(found, "nmbus_messages_retried_total", type="obs.Good", **q) == 0
    assert not any("made.up" in str(labels) for _, labels in found)
    # Handler runs: 5 good, 2 x 2 attempts of bad; the unknown type runs no handler.
    assert value(found, "nmbus_handler_duration_seconds_count", type="obs.Good", **q) == 5
    assert value(found, "nmbus_handler_duration_seconds_count", type="obs.Bad", **q) == 4
    buckets = "nmbus_handler_duration_seconds_bucket"
    assert value(found, buckets, type="obs.Good", le="+Inf", **q) == 5
    assert value(found, "nmbus_handler_duration_seconds_sum", type="obs.Good", **q) > 0
    # Every outcome committed belongs to one batch of at most batch_size (3).
    assert value(found, "nmbus_batch_size_sum", **q) == 10
    batches = value(found, "nmbus_batch_size_count", **q)
    assert 10 / 3 <= batches <= 10
    assert value(found, "nmbus_batch_size_bucket", le="5.0", **q) == batches
    assert ("nmbus_lease_renewals_total", (("queue", "metered"),)) in found
    # Every series docs/metrics.md promises for a worker is exposed, under its type.
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    for series, kind in documented_worker_series():
        family = series.removesuffix("_total") if kind == "counter" else series
        assert families.get(family) == kind, f"{series} ({kind}) documented, not served"
    # The server is gone with the bus.
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(scrape, port)


async def test_lease_renewals_are_counted(make_bus: Callable[..., Bus]) -> None:
    bus = make_bus("renewing", metrics_port=0, lease_seconds=1.5)
    done = asyncio.Event()

    @bus.handler
    async def slow(msg: Slow, ctx: Context) -> None:
        await asyncio.sleep(msg.seconds)
        done.set()

    async with bus:
        await bus.send(Slow(seconds=1.2), to="renewing")
        await asyncio.wait_for(done.wait(), 60)
        port = bus.metrics_port
        assert port is not None
        found = samples(await asyncio.to_thread(scrape, port))
    # The renewer runs every lease/3 = 0.5 s: a 1.2 s handler is renewed at least twice.
    assert value(found, "nmbus_lease_renewals_total", queue="renewing") >= 2
    assert unmoved(found, "nmbus_lease_renewal_failures_total", queue="renewing") == 0


async def test_flow_limits_report_their_waits_and_what_they_hold_back(
    make_bus: Callable[..., Bus], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_module, "HELD_BACK_INTERVAL", 0.1)
    # Two loops: the one that runs the message the limit lets through is busy in its
    # handler, so only the other can wait for room (one loop alone never waits here).
    bus = make_bus("limited", metrics_port=0, poll_interval=0.1, concurrency=2)
    release = asyncio.Event()

    @bus.handler(concurrency=1)
    async def slow(msg: Slow, ctx: Context) -> None:
        await release.wait()

    async with bus:
        for _ in range(4):
            await bus.send(Slow(seconds=0), to="limited")
        port = bus.metrics_port
        assert port is not None
        key = "obs.Slow:test_flow_limits_report_their_waits_and_what_they_hold_back.<locals>.slow"

        async def exposed() -> Samples:
            return samples(await asyncio.to_thread(scrape, port))

        async def held() -> float:
            series = ("nmbus_flow_held_back_messages", (("handler", key), ("queue", "limited")))
            return (await exposed()).get(series, -1)

        # One runs, the concurrency limit holds the other three back.
        await wait_until(held, until=lambda n: n == 3, timeout=30)
        # The idle loop's claims take nothing while the three wait: each of its waits
        # for room is counted when it ends (a recheck, at most every poll interval).
        # Counted from here, while the three are held back: a wait counted as the bus
        # started (a claim that ran before a send committed, its probe after) is not one.
        before = await exposed()
        waits, seconds = "nmbus_flow_waits_total", "nmbus_flow_wait_seconds_total"
        found = await wait_until(
            exposed,
            until=lambda found: (
                value(found, waits, queue="limited") > value(before, waits, queue="limited")
            ),
            timeout=30,
            what="a flow wait counted while three messages are held back",
        )
        assert value(found, seconds, queue="limited") > value(before, seconds, queue="limited")
        release.set()
        await wait_until(held, until=lambda n: n == 0, timeout=30)


async def test_two_buses_in_one_process_keep_their_own_series(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    one, two = make_bus("one", metrics_port=0), make_bus("two", metrics_port=0)
    for bus in (one, two):

        @bus.handler
        async def good(msg: Good, ctx: Context) -> None:
            pass

    async with one, two:
        assert one.metrics_port != two.metrics_port
        await one.send(Good(n=1), to="one")
        for n in range(3):
            await two.send(Good(n=n), to="two")
        await wait_rows(db, "one", {"X": 1})
        await wait_rows(db, "two", {"X": 3})
        await wait_until(
            lambda: (one.worker.outcomes["X"], two.worker.outcomes["X"]),
            until=lambda done: done[0] >= 1 and done[1] >= 3,
            interval=0.01,
        )
        assert one.metrics_port is not None and two.metrics_port is not None
        first = samples(await asyncio.to_thread(scrape, one.metrics_port))
        second = samples(await asyncio.to_thread(scrape, two.metrics_port))
    handled = "nmbus_messages_handled_total"
    assert value(first, handled, queue="one", type="obs.Good") == 1
    assert value(second, handled, queue="two", type="obs.Good") == 3
    assert not any(("queue", "two") in labels for _, labels in first)
    assert not any(("queue", "one") in labels for _, labels in second)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_a_taken_port_is_a_clear_error_and_a_freed_one_can_be_reused(
    make_bus: Callable[..., Bus],
) -> None:
    port = _free_port()
    first = make_bus("first", metrics_port=port)
    async with first:
        assert first.metrics_port == port
        second = make_bus("second", metrics_port=port)
        with pytest.raises(ConfigurationError, match=rf"cannot serve metrics on 127.0.0.1:{port}"):
            await second.start()
    # Stopping the first bus freed the port.
    third = make_bus("third", metrics_port=port)
    async with third:
        assert "nmbus_batch_size" in await asyncio.to_thread(scrape, port)


def test_the_server_binds_to_loopback_by_default() -> None:
    assert Settings().metrics_host == "127.0.0.1"


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"metrics_port": -1}, "metrics_port (NMBUS_METRICS_PORT)"),
        ({"metrics_port": 65536}, "metrics_port (NMBUS_METRICS_PORT)"),
        ({"metrics_port": "http"}, "metrics_port (NMBUS_METRICS_PORT)"),
        ({"metrics_port": 1.5}, "metrics_port (NMBUS_METRICS_PORT)"),
        ({"metrics_host": ""}, "metrics_host (NMBUS_METRICS_HOST)"),
        ({"metrics_host": "local host"}, "metrics_host (NMBUS_METRICS_HOST)"),
        ({"metrics_host": "x" * 300}, "metrics_host (NMBUS_METRICS_HOST)"),
    ],
)
def test_absurd_metrics_settings_are_refused(values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(InvalidSetting, match=complaint.replace("(", r"\(").replace(")", r"\)")):
        Bus("refused", dsn="postgresql://nobody@127.0.0.1:1/none", **values)


def test_the_environment_variable_turns_metrics_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NMBUS_METRICS_PORT", "0")
    bus = Bus("from_env", dsn="postgresql://nobody@127.0.0.1:1/none")
    assert bus.metrics is not None and bus.worker.metrics is bus.metrics
    monkeypatch.setenv("NMBUS_METRICS_PORT", "99999")
    with pytest.raises(InvalidSetting, match="NMBUS_METRICS_PORT"):
        Bus("from_env", dsn="postgresql://nobody@127.0.0.1:1/none")


def test_metrics_off_builds_nothing() -> None:
    bus = Bus("quiet", dsn="postgresql://nobody@127.0.0.1:1/none")
    assert bus.metrics is None and bus.metrics_port is None
    assert bus.worker.metrics is None and bus.worker.dispatcher.metrics is None


def _start_worker(dsn: str, target: str) -> subprocess.Popen[str]:
    env = {**os.environ, "NMBUS_DSN": dsn, "NMBUS_METRICS_PORT": "0"}
    return subprocess.Popen(
        [sys.executable, "-m", "nmbus", "worker", target],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


async def test_nmbus_worker_serves_metrics_from_the_environment(dsn: str) -> None:
    """``NMBUS_METRICS_PORT=0 nmbus worker ...``: the port is in its bus_started line."""
    async with Bus("sender", dsn=dsn, concurrency=0) as sender:
        for n in range(2):
            await sender.send(Ping(n=n), to="clitest")
    proc = _start_worker(dsn, "tests.cli_app:bus")
    try:
        assert proc.stderr is not None
        async with asyncio.timeout(60):
            while "bus_started" not in (line := await asyncio.to_thread(proc.stderr.readline)):
                assert line, "the worker exited before starting"
        match = re.search(r"metrics_port=(\d+)", line)
        assert match, line
        port = int(match.group(1))
        key = ("nmbus_messages_handled_total", (("queue", "clitest"), ("type", "test.Ping")))

        async def scraped() -> Samples:
            return samples(await asyncio.to_thread(scrape, port))

        found = await wait_until(
            scraped, until=lambda found: found.get(key) == 2, timeout=60, interval=0.2
        )
        assert (
            value(found, "nmbus_handler_duration_seconds_sum", queue="clitest", type="test.Ping")
            >= 4
        )
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def test_durations_and_batch_sizes_land_in_the_right_buckets() -> None:
    from prometheus_client import generate_latest

    from nmbus.ports.store import Outcomes
    from nmbus.telemetry.metrics import WorkerMetrics

    metrics = WorkerMetrics("unit")
    for seconds in (0.0001, 0.00011, 0.5, 100.0):
        metrics.handler_ran("obs.Good", seconds)
    for size in (1, 3, 100, 101):
        outcomes = Outcomes()
        for n in range(size):
            outcomes.add(n, "X")
        metrics.committed([], outcomes)
    metrics.leases_renewed(7)
    metrics.lease_renewal_failed()
    found = samples(generate_latest(metrics.registry).decode())
    q = {"queue": "unit", "type": "obs.Good"}
    bucket = "nmbus_handler_duration_seconds_bucket"
    assert value(found, bucket, le="0.0001", **q) == 1  # le is inclusive
    assert value(found, bucket, le="0.00025", **q) == 2
    assert value(found, bucket, le="0.5", **q) == 3
    assert value(found, bucket, le="60.0", **q) == 3
    assert value(found, bucket, le="+Inf", **q) == 4
    assert value(found, "nmbus_handler_duration_seconds_count", **q) == 4
    assert value(found, "nmbus_handler_duration_seconds_sum", **q) == pytest.approx(100.50021)
    sizes = "nmbus_batch_size_bucket"
    assert value(found, sizes, le="1.0", queue="unit") == 1
    assert value(found, sizes, le="5.0", queue="unit") == 2
    assert value(found, sizes, le="100.0", queue="unit") == 3
    assert value(found, sizes, le="200.0", queue="unit") == 4
    assert value(found, "nmbus_batch_size_sum", queue="unit") == 205
    # Rows of unknown type ids (no batch given): counted under (unknown).
    assert value(found, "nmbus_messages_handled_total", queue="unit", type="(unknown)") == 205
    assert value(found, "nmbus_lease_renewals_total", queue="unit") == 7
    assert value(found, "nmbus_lease_renewal_failures_total", queue="unit") == 1


async def test_a_batch_committed_in_parts_is_one_batch_of_its_size(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # Each handler outlasts batch_commit_interval: the batch of six commits in
    # parts, and nmbus_batch_size still sees one batch of six ("batch fill").
    bus = make_bus("metered", metrics_port=0, batch_size=10, batch_commit_interval=0.01)

    @bus.handler
    async def slow(msg: Slow, ctx: Context) -> None:
        await asyncio.sleep(msg.seconds)

    async with make_bus("metered", concurrency=0) as sender:
        for _ in range(6):
            await sender.send(Slow(seconds=0.05), to="metered")
    async with bus:
        port = bus.metrics_port
        assert port is not None
        await wait_rows(db, "metered", {"X": 6})
        async with asyncio.timeout(30):
            while bus.worker.outcomes["X"] < 6:
                await asyncio.sleep(0.01)
        found = samples(await asyncio.to_thread(scrape, port))
    q = {"queue": "metered"}
    assert value(found, "nmbus_messages_handled_total", type="obs.Slow", **q) == 6
    assert value(found, "nmbus_batch_size_sum", **q) == 6
    assert value(found, "nmbus_batch_size_count", **q) == 1
