"""The supervised-service helper: backoff, restart, return, stop; and the LISTEN loop on it.

Real asyncio throughout: services that fail, return or hang, timed by the
event loop's own clock.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import asyncpg
import pytest
import structlog
from structlog.testing import capture_logs

from nmbus.maintenance import supervise as supervision
from nmbus.maintenance.supervise import FIRST_PAUSE, SPREAD, Backoff, Services, supervise
from nmbus.postgres.listen import listen_loop, notify_channel
from tests.waits import wait_until


class Logger:
    """A logger object for the helper: every call kept as (level, event, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        def log(event: str, **fields: Any) -> None:
            self.lines.append((level, event, fields))

        return log

    def events(self, event: str) -> list[dict[str, Any]]:
        return [fields for _, name, fields in self.lines if name == event]


# -- the pauses --------------------------------------------------------------------------


def test_the_pauses_double_from_the_first_and_stop_at_the_cap() -> None:
    backoff = Backoff(cap=3.0)
    pauses = [backoff.next() for _ in range(60)]
    assert pauses[0] == FIRST_PAUSE
    doubled = [min(3.0, FIRST_PAUSE * 2**n) for n in range(60)]
    for pause, ceiling in zip(pauses, doubled, strict=True):
        assert max(FIRST_PAUSE, ceiling * (1 - SPREAD)) <= pause <= ceiling
    # Grown to the cap, and spread below it: processes do not come back in step.
    assert all(3.0 * (1 - SPREAD) <= p <= 3.0 for p in pauses[6:])
    assert len(set(pauses[6:])) > 1
    assert backoff.failures == 60


def test_a_thousand_failures_in_a_row_stay_at_the_cap() -> None:
    backoff = Backoff(cap=10.0)
    for _ in range(1000):
        pause = backoff.next()
    assert 8.0 <= pause <= 10.0


def test_a_reset_starts_again_from_the_first_pause() -> None:
    backoff = Backoff(cap=10.0)
    for _ in range(5):
        backoff.next()
    backoff.reset()
    assert backoff.failures == 0
    assert backoff.next() == FIRST_PAUSE


def test_a_cap_below_the_first_pause_is_the_pause() -> None:
    backoff = Backoff(cap=0.05)
    assert [backoff.next() for _ in range(3)] == [0.05, 0.05, 0.05]


# -- restarting ----------------------------------------------------------------------------


async def test_a_failing_service_is_logged_and_restarted_with_growing_pauses() -> None:
    logger = Logger()
    calls = 0
    done = asyncio.Event()

    async def service() -> None:
        nonlocal calls
        calls += 1
        if calls <= 3:
            raise RuntimeError(f"failure {calls}")
        done.set()

    task = asyncio.create_task(supervise(service, "renewer", logger, 10.0, queue="billing"))
    await wait_until(done.is_set, timeout=10, what="the fourth start")
    await asyncio.wait_for(task, 1)  # returned on its own at last: not started again
    assert calls == 4
    failures = logger.events("background_task_failed")
    assert [f["error"] for f in failures] == [f"RuntimeError: failure {n}" for n in (1, 2, 3)]
    assert all(f["task"] == "renewer" and f["queue"] == "billing" for f in failures)
    assert all("Traceback" in f["traceback"] for f in failures)
    pauses = [f["restart_in"] for f in failures]
    assert pauses[0] == FIRST_PAUSE
    assert pauses[0] < pauses[1] < pauses[2] <= 0.4


async def test_the_pauses_between_restarts_are_waited() -> None:
    loop = asyncio.get_running_loop()
    starts: list[float] = []

    async def service() -> None:
        starts.append(loop.time())
        raise RuntimeError("down")

    task = asyncio.create_task(supervise(service, "listener", Logger(), 0.2))
    try:
        await wait_until(lambda: len(starts), until=lambda n: n >= 4, timeout=10)
    finally:
        task.cancel()
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # 0.1, then 0.16-0.2 (the cap) each time: never shorter than the first pause.
    assert all(gap >= FIRST_PAUSE * 0.95 for gap in gaps), gaps
    assert all(gap < 1.0 for gap in gaps), gaps


async def test_a_service_that_ran_long_before_failing_restarts_after_the_first_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(supervision, "HEALTHY_SECONDS", 0.05)
    logger = Logger()

    async def service() -> None:
        await asyncio.sleep(0.1)  # "healthy" for longer than HEALTHY_SECONDS
        raise RuntimeError("late failure")

    task = asyncio.create_task(supervise(service, "retention", logger, 10.0))
    try:
        await wait_until(
            lambda: len(logger.events("background_task_failed")), until=lambda n: n >= 3
        )
    finally:
        task.cancel()
    assert {f["restart_in"] for f in logger.events("background_task_failed")} == {FIRST_PAUSE}


async def test_a_stray_cancellation_inside_the_service_is_a_failure() -> None:
    logger = Logger()
    calls = 0

    async def service() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise asyncio.CancelledError  # a task someone else cancelled, awaited here

    await asyncio.wait_for(supervise(service, "periodic", logger, 1.0), 5)
    assert calls == 2
    assert [f["error"] for f in logger.events("background_task_failed")] == ["CancelledError"]


async def test_a_report_replaces_the_default_log_line() -> None:
    reported: list[tuple[str, float]] = []
    logger = Logger()
    calls = 0

    async def service() -> None:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise ConnectionError("lost")

    def report(exc: BaseException, pause: float) -> None:
        reported.append((str(exc), pause))

    await asyncio.wait_for(supervise(service, "loop", logger, 1.0, report=report), 5)
    assert [text for text, _ in reported] == ["lost", "lost"]
    assert reported[0][1] == FIRST_PAUSE
    assert logger.lines == []


# -- returning -----------------------------------------------------------------------------


async def test_a_service_that_returns_is_done_and_not_restarted() -> None:
    logger = Logger()
    calls = 0

    async def service() -> None:
        nonlocal calls
        calls += 1

    await asyncio.wait_for(supervise(service, "subscriptions", logger, 1.0), 1)
    assert calls == 1
    assert logger.lines == []


async def test_a_service_meant_to_go_again_is_restarted_after_a_return() -> None:
    logger = Logger()
    backoff = Backoff(1.0)
    calls = 0

    async def session() -> None:  # a connection that is lost at once, quietly
        nonlocal calls
        calls += 1

    task = asyncio.create_task(
        supervise(session, "listener", logger, 1.0, restart=True, backoff=backoff)
    )
    try:
        await wait_until(lambda: calls, until=lambda n: n >= 3, timeout=10)
    finally:
        task.cancel()
    assert logger.lines == []  # a return is not a failure
    assert backoff.failures >= 2  # but it is paced like one: no busy loop


async def test_a_service_that_resets_its_backoff_when_healthy_starts_again_soon() -> None:
    reported: list[float] = []
    backoff = Backoff(10.0)
    calls = 0

    async def session() -> None:
        nonlocal calls
        calls += 1
        if calls % 2 == 0:
            backoff.reset()  # connected this time, then lost
        raise ConnectionError("lost")

    task = asyncio.create_task(
        supervise(
            session,
            "listener",
            Logger(),
            10.0,
            restart=True,
            backoff=backoff,
            report=lambda _exc, pause: reported.append(pause),
        )
    )
    try:
        await wait_until(lambda: len(reported), until=lambda n: n >= 6, timeout=10)
    finally:
        task.cancel()
    # Reset every second time: 0.1, 0.1, 0.16-0.2, 0.1, 0.16-0.2, 0.1, ...
    assert reported[0] == reported[1] == reported[3] == reported[5] == FIRST_PAUSE
    assert all(p <= 0.2 for p in reported), reported


# -- stopping ------------------------------------------------------------------------------


async def test_a_cancellation_stops_a_running_service_at_once() -> None:
    cleaned = asyncio.Event()
    running = asyncio.Event()

    async def service() -> None:
        running.set()
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.set()

    task = asyncio.create_task(supervise(service, "leases", Logger(), 10.0))
    await wait_until(running.is_set)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 1)
    assert cleaned.is_set()


async def test_a_cancellation_ends_a_long_pause_at_once() -> None:
    logger = Logger()

    async def service() -> None:
        raise RuntimeError("down")

    # A pause of a minute after the failure.
    slow = Backoff(cap=60.0, first=60.0)
    task = asyncio.create_task(supervise(service, "forwarder", logger, 60.0, backoff=slow))
    await wait_until(lambda: logger.events("background_task_failed"))
    loop = asyncio.get_running_loop()
    began = loop.time()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert loop.time() - began < 1.0


async def test_a_stop_event_ends_the_pause_and_starts_nothing_again() -> None:
    stop = asyncio.Event()
    calls = 0

    async def service() -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("down")

    slow = Backoff(cap=60.0, first=60.0)
    task = asyncio.create_task(
        supervise(service, "loop", Logger(), 60.0, restart=True, backoff=slow, stop=stop)
    )
    await wait_until(lambda: calls)
    stop.set()
    await asyncio.wait_for(task, 1)  # returns: a stop is not a cancellation
    assert calls == 1


async def test_a_return_after_the_stop_event_is_not_restarted() -> None:
    stop = asyncio.Event()
    calls = 0

    async def session() -> None:
        nonlocal calls
        calls += 1
        await stop.wait()  # serves until told to stop, then returns

    task = asyncio.create_task(supervise(session, "loop", Logger(), 1.0, restart=True, stop=stop))
    await wait_until(lambda: calls)
    stop.set()
    await asyncio.wait_for(task, 1)
    assert calls == 1


async def test_services_start_by_name_and_stop_together() -> None:
    logger = Logger()
    started: set[str] = set()
    ended: set[str] = set()

    def forever(name: str) -> Any:
        async def run() -> None:
            started.add(name)
            try:
                await asyncio.Event().wait()
            finally:
                ended.add(name)

        return run

    services = Services(logger, 1.0, "nmbus-billing", queue="billing")
    services.start("listener", forever("listener"))
    services.start("leases", forever("leases"))
    assert sorted(t.get_name() for t in services.tasks) == [
        "nmbus-billing-leases",
        "nmbus-billing-listener",
    ]
    await wait_until(lambda: len(started), until=lambda n: n == 2)
    await asyncio.wait_for(services.stop(), 1)
    assert ended == {"listener", "leases"}
    assert services.tasks == []
    await services.stop()  # a second stop is harmless


# -- the LISTEN loop -----------------------------------------------------------------------


async def test_the_listen_loop_reconnects_after_its_connection_is_killed(
    dsn: str, db: asyncpg.Connection
) -> None:
    channel = notify_channel("nmbus")
    seen: list[str] = []
    with capture_logs() as logs:
        task = asyncio.create_task(
            listen_loop(
                lambda: asyncpg.connect(dsn),
                channel,
                seen.append,
                0.5,
                structlog.get_logger("nmbus.test"),
            )
        )
        try:
            # Connected: everything is looked at once.
            await wait_until(lambda: seen.count("*"))
            killed = await db.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE pid <> pg_backend_pid() AND datname = current_database()"
            )
            assert killed == 1
            # Connected again, and listening on the new connection.
            await wait_until(lambda: seen.count("*"), until=lambda n: n >= 2)
            await db.execute("SELECT pg_notify($1, 'billing')", channel)
            await wait_until(lambda: "billing" in seen)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    lost = [e for e in logs if e["event"] == "listener_connection_lost"]
    assert lost and all(e["channel"] == channel for e in lost)
    assert not [e for e in logs if e["event"] == "listener_failed"]


def test_the_channel_names() -> None:
    assert notify_channel("nmbus") == "nmbus_nmbus"
    assert notify_channel("shop", outbox=True) == "nmbus_outbox_shop"
