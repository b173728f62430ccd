"""Periodic messages (docs/delivery.md): one tick per due time across processes."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from nmbus import Bus, ConfigurationError, Context, HandlerError, Tick
from nmbus.delivery.periodic import Schedule, Scheduler
from nmbus.envelopes import EnvelopeBuilder
from nmbus.ports.operations import RetentionPolicy
from nmbus.postgres import PostgresStore
from nmbus.postgres.retention import clean_queue
from nmbus.postgres.segments import advance
from nmbus.testing import MemoryStore, drain
from tests import procs
from tests.waits import wait_until


async def noop(tick: Tick, ctx: Context) -> None:
    pass


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def test_every_is_due_at_multiples_of_its_period_since_the_epoch() -> None:
    s = Schedule.of(noop, 60.0, None, None, "last")
    assert s.latest(at("2026-11-23 13:05:42.5")) == at("2026-11-23 13:05:00")
    assert s.after(at("2026-11-23 13:05:42.5")) == at("2026-11-23 13:06:00")
    assert s.after(at("2026-11-23 13:06:00")) == at("2026-11-23 13:07:00")
    assert s.name == "noop"
    assert s.unique_id(at("2026-11-23 13:05:00")) == "nmbus.tick:noop:2026-11-23T13:05:00+00:00"


def test_a_cron_schedule_is_parsed_and_due_at_its_next_time() -> None:
    s = Schedule.of(noop, None, "*/5 * * * *", "sweep", "last")
    assert s.latest(at("2026-11-23 13:07:10")) == at("2026-11-23 13:05:00")
    assert s.latest(at("2026-11-23 13:10:00")) == at("2026-11-23 13:10:00")
    assert s.after(at("2026-11-23 13:07:10")) == at("2026-11-23 13:10:00")
    seconds = Schedule.of(noop, None, "* * * * * */2", "fast", "last")
    assert seconds.after(at("2026-11-23 13:07:11")) == at("2026-11-23 13:07:12")


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({}, "exactly one"),
        ({"every": 1, "cron": "* * * * *"}, "exactly one"),
        ({"every": 0}, "at least 0.1"),
        ({"every": -5}, "at least 0.1"),
        ({"every": float("inf")}, "at least 0.1"),
        ({"every": float("nan")}, "at least 0.1"),
        ({"every": "60"}, "must be seconds"),
        ({"cron": "every five minutes"}, "not a valid cron"),
        ({"cron": "61 * * * *"}, "not a valid cron"),
        # Issue 23 defect 6: accepted, then failing for ever at run time.
        ({"cron": "0 0 30 2 *"}, "never falls due"),
        ({"cron": "0 0 31 4 *"}, "never falls due"),
        ({"cron": "0 0 1 1 * 0 2099"}, "7 fields"),
        ({"cron": "* * * *"}, "not a valid cron"),
        ({"every": 1, "missed": "all"}, "'last' or 'skip'"),
        ({"every": 1, "name": ""}, "1-100 characters"),
    ],
)
def test_bad_schedules_are_refused_when_the_decorator_runs(
    kwargs: dict[str, object], error: str
) -> None:
    bus = Bus("clock", store=MemoryStore())
    with pytest.raises(ConfigurationError, match=error):
        bus.periodic(**kwargs)(noop)  # type: ignore[arg-type]


def test_a_periodic_handler_must_be_async_and_take_tick_and_ctx() -> None:
    bus = Bus("clock", store=MemoryStore())

    def sync(tick: Tick, ctx: Context) -> None:
        pass

    async def one(tick: Tick) -> None:
        pass

    with pytest.raises(HandlerError, match="async"):
        bus.periodic(every=1)(sync)  # type: ignore[arg-type]
    with pytest.raises(HandlerError, match=r"\(tick, ctx\)"):
        bus.periodic(every=1)(one)  # type: ignore[arg-type]
    bus.periodic(every=1)(noop)
    with pytest.raises(ConfigurationError, match="twice"):
        bus.periodic(every=5)(noop)


async def test_a_schedule_that_fails_at_run_time_never_stops_the_others(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    """Issue 23 defect 6: one never-matching cron stopped every schedule of its endpoint.

    Registration refuses such a cron now; one that fails anyway (put in behind
    the decorator's back here) is left out and the valid schedule still fires.
    """
    bus = make_bus("clock", poll_interval=0.2)
    seen: list[Tick] = []

    @bus.periodic(every=0.2, missed="skip")
    async def fast(tick: Tick, ctx: Context) -> None:
        seen.append(tick)

    broken = Schedule("broken", noop, cron="0 0 30 2 *")
    good = dict(bus._schedules)
    bus._schedules.clear()
    bus._schedules.update({"broken": broken, **good})  # the broken one runs first
    async with bus:
        await wait_until(lambda: len(seen), until=lambda n: n >= 3, timeout=15)
    assert {t.name for t in seen} == {"fast"}
    names = await db.fetch("SELECT DISTINCT label, unique_id FROM nmbus.clock")
    assert all(":fast:" in r["unique_id"] for r in names)


async def test_after_downtime_only_the_last_missed_tick_is_enqueued() -> None:
    store = MemoryStore()
    await store.ensure_queue("clock")
    now = [at("2026-11-23 13:05:42")]
    last = Schedule.of(noop, 60.0, None, "last", "last")
    skip = Schedule.of(noop, 60.0, None, "skip", "skip")
    scheduler = Scheduler("clock", store, EnvelopeBuilder(10_000), [last, skip], lambda: now[0])
    task = asyncio.create_task(scheduler.run())
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    ids = [r.unique_id for r in store.rows("clock")]
    assert ids == ["nmbus.tick:last:2026-11-23T13:05:00+00:00"]
    # A second process (or a restart) in the same minute adds nothing.
    task = asyncio.create_task(scheduler.run())
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert len(store.rows("clock")) == 1


async def test_a_one_second_cron_schedule_fires_and_its_handler_gets_the_tick(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("clock", poll_interval=0.2)
    seen: list[Tick] = []

    @bus.periodic(cron="* * * * * *", missed="skip")
    async def every_second(tick: Tick, ctx: Context) -> None:
        seen.append(tick)

    async with bus:
        await wait_until(lambda: len(seen), until=lambda n: n >= 2, timeout=10)
    first = seen[0]
    assert first.name == "every_second"
    assert first.scheduled_at.microsecond == 0
    assert seen[1].scheduled_at - first.scheduled_at == timedelta(seconds=1)
    row = await db.fetchrow(
        "SELECT label, unique_id, subqueue FROM nmbus.clock ORDER BY id LIMIT 1"
    )
    assert row["label"] == "nmbus.Tick"
    assert row["unique_id"] == f"nmbus.tick:every_second:{first.scheduled_at.isoformat()}"


async def test_two_processes_give_one_tick_per_second_none_twice(
    dsn: str, db: asyncpg.Connection
) -> None:
    workers = [procs.Proc("tests.delivery_workers", "periodic", dsn, "5.5") for _ in range(2)]
    try:
        for w in workers:
            await w.wait_for("ready")
        for w in workers:
            await w.wait_for("stopped", timeout=30)
    finally:
        for w in workers:
            w.kill()
    handled = [line.split()[2] for w in workers for line in w.lines if line.startswith("tick ")]
    counts = Counter(handled)
    assert counts and max(counts.values()) == 1, counts
    times = sorted(datetime.fromisoformat(t) for t in counts)
    assert len(times) >= 4
    assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(times))
    rows = await db.fetch("SELECT unique_id, subqueue FROM nmbus.clock")
    assert len(rows) == len({r["unique_id"] for r in rows})
    # Every stored tick was handled once (the last may still be waiting at shutdown).
    assert {r["subqueue"] for r in rows} <= {"X", "I"}
    assert sum(r["subqueue"] == "X" for r in rows) == len(handled)


# -- once per due time, whatever retention does (issue 23, defect 2) ------------------


async def test_a_tick_that_retention_removed_does_not_run_again_at_restart(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    handled: list[tuple[str, datetime]] = []

    def endpoint(marker: bool) -> Bus:
        bus = make_bus("clock", poll_interval=0.2)

        @bus.periodic(every=3600)
        async def hourly(tick: Tick, ctx: Context) -> None:
            handled.append((tick.name, tick.scheduled_at))

        if marker:
            # New in the second run, so it is due at start; a scheduler tries its
            # schedules in order, so once this tick is handled, hourly's try is done.
            @bus.periodic(every=3600)
            async def marker_(tick: Tick, ctx: Context) -> None:
                handled.append((tick.name, tick.scheduled_at))

        return bus

    async with endpoint(marker=False) as bus:
        await wait_until(lambda: handled, timeout=15)
        await drain(bus)
    # nmbus cleanup --older-than 0s: the processed tick's row goes (with its segment).
    await advance(db, "nmbus", "clock")
    await clean_queue(db, "nmbus", "clock", RetentionPolicy(max_age=timedelta(0)))
    assert await db.fetchval("SELECT count(*) FROM nmbus.clock") == 0

    async with endpoint(marker=True) as bus:
        await wait_until(lambda: any(name == "marker_" for name, _ in handled), timeout=15)
        await drain(bus)
    due_times = Counter(at for name, at in handled if name == "hourly")
    assert max(due_times.values()) == 1, due_times


async def test_concurrent_processes_enqueue_a_due_time_once_before_and_after_retention(
    dsn: str, db: asyncpg.Connection
) -> None:
    store = PostgresStore(dsn, pool_size=8)
    await store.open()
    try:
        schedule = Schedule.of(noop, 3600.0, None, "hourly", "last")
        due = schedule.latest(datetime.now(UTC))
        # Eight processes' schedulers, each on its own connection, at once.
        builder = EnvelopeBuilder(10_000)
        processes = [Scheduler("clock", store, builder, [schedule]) for _ in range(8)]

        async def everyone(at: datetime) -> list[bool]:
            return sorted(await asyncio.gather(*(p.enqueue(schedule, at) for p in processes)))

        assert await everyone(due) == [False] * 7 + [True]
        await db.execute("DELETE FROM nmbus.clock")  # what retention does to the handled tick
        assert await everyone(due) == [False] * 8
        assert await everyone(due - timedelta(hours=1)) == [False] * 8  # the past stays past
        following = due + timedelta(hours=1)
        assert await everyone(following) == [False] * 7 + [True]
        rows = await db.fetch("SELECT unique_id FROM nmbus.clock")
        assert [r[0] for r in rows] == [schedule.unique_id(following)]
        record = await db.fetchrow('SELECT * FROM nmbus."periodic$due"')
        assert (record["endpoint"], record["schedule"], record["last_due"]) == (
            "clock",
            "hourly",
            following,
        )
    finally:
        await store.close()


async def test_a_process_whose_clock_ran_ahead_does_not_stop_the_schedule_of_the_others(
    dsn: str, db: asyncpg.Connection
) -> None:
    store = PostgresStore(dsn)
    await store.open()
    try:
        schedule = Schedule.of(noop, 60.0, None, "minutely", "last")
        scheduler = Scheduler("clock", store, EnvelopeBuilder(10_000), [schedule])
        now = datetime.now(UTC)
        # A host whose clock is a year ahead enqueues the due time it sees.
        assert await scheduler.enqueue(schedule, schedule.latest(now + timedelta(days=365)))
        # The processes whose clocks are right still enqueue theirs, once each.
        on_time = schedule.latest(now)
        assert await scheduler.enqueue(schedule, on_time)
        assert not await scheduler.enqueue(schedule, on_time)
        await db.execute("DELETE FROM nmbus.clock")  # what retention does to handled ticks
        assert not await scheduler.enqueue(schedule, on_time)
        assert await scheduler.enqueue(schedule, on_time + timedelta(minutes=1))
    finally:
        await store.close()
