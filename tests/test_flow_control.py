"""Flow control: limits that hold across processes, enforced where messages are claimed.

DESIGN.md section 10, docs/flow-control.md. The limited handlers run in two
worker processes (tests/flow_workers.py), each with two loops, and log every
start and end to flow_log; the limits are checked on those times.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from structlog.testing import capture_logs

from nmbus import Bus, Context
from nmbus.delivery.flow import FlowLimits, Limits
from nmbus.errors import ConfigurationError, HandlerError, InvalidMessage
from nmbus.ops.admin import Admin
from nmbus.postgres.floor import NO_FLOOR
from nmbus.postgres.flow import claim_limited
from nmbus.testing import MemoryStore
from tests.cookbook_run import psql
from tests.messages import Ping, Pong
from tests.procs import Proc
from tests.waits import wait_until

LOG = """CREATE TABLE flow_log (n int, kind text, grp text, pid int,
                               started timestamptz, ended timestamptz)"""


@asynccontextmanager
async def workers(
    dsn: str,
    *,
    concurrency: object = "-",
    rate: object = "-",
    group_concurrency: object = "-",
    sleep: float = 0.2,
    lease: float = 30.0,
    processes: int = 2,
    loops: int = 2,
) -> AsyncIterator[list[Proc]]:
    args = [str(a) for a in (concurrency, rate, group_concurrency, sleep, lease, loops)]
    procs = [Proc("tests.flow_workers", dsn, "billing", *args) for _ in range(processes)]
    try:
        for proc in procs:
            await proc.wait_for("ready")
        yield procs
    finally:
        for proc in procs:
            proc.kill()


async def send(dsn: str, messages: list[tuple[object, str | None]]) -> None:
    async with Bus("shop", dsn=dsn, concurrency=0, create_queues=True) as sender:
        for message, group in messages:
            await sender.send(message, to="billing", group=group)  # type: ignore[arg-type]


def overlaps(rows: list[asyncpg.Record]) -> Iterator[int]:
    """How many handlers ran at once, after each start and end."""
    events = sorted(
        [(r["started"], 1) for r in rows] + [(r["ended"], -1) for r in rows],
        key=lambda e: (e[0], e[1]),  # an end before a start at the same instant
    )
    running = 0
    for _, step in events:
        running += step
        yield running


async def log_rows(db: asyncpg.Connection, kind: str = "ping") -> list[asyncpg.Record]:
    return await db.fetch("SELECT * FROM flow_log WHERE kind = $1 ORDER BY started", kind)


@pytest.fixture
async def log(db: asyncpg.Connection) -> asyncpg.Connection:
    await db.execute(LOG)
    return db


async def test_concurrency_holds_across_two_processes_and_is_reached(
    dsn: str, log: asyncpg.Connection
) -> None:
    async with workers(dsn, concurrency=3, sleep=0.3):
        await send(dsn, [(Ping(n=n), None) for n in range(30)])
        await wait_until("SELECT count(*) FROM flow_log", db=log, until=lambda n: n == 30)
    rows = await log_rows(log)
    assert max(overlaps(rows)) == 3  # never more, and reached
    assert len({r["pid"] for r in rows}) == 2  # both processes took part


async def test_held_back_messages_let_other_types_and_groups_flow_past(
    dsn: str, log: asyncpg.Connection
) -> None:
    async with workers(dsn, concurrency=1, group_concurrency=1, sleep=1.0):
        # A backlog of the limited type, then other work behind it.
        await send(dsn, [(Ping(n=n), "big") for n in range(20)])
        await send(dsn, [(Pong(n=n), None) for n in range(5)])
        await wait_until(
            "SELECT count(*) FROM flow_log WHERE kind = 'pong'", db=log, until=lambda n: n == 5
        )
        assert len(await log_rows(log)) <= 2  # the backlog still waits, in I
        waiting = await log.fetchval(
            "SELECT count(*) FROM nmbus.billing WHERE subqueue = 'I' AND label = 'test.Ping'"
        )
        assert waiting >= 17


async def test_group_concurrency_holds_per_group_and_groups_run_side_by_side(
    dsn: str, log: asyncpg.Connection
) -> None:
    async with workers(dsn, group_concurrency=1, sleep=0.3):
        await send(dsn, [(Ping(n=n), f"tenant-{n % 3}") for n in range(15)])
        await wait_until("SELECT count(*) FROM flow_log", db=log, until=lambda n: n == 15)
    rows = await log_rows(log)
    for group in ("tenant-0", "tenant-1", "tenant-2"):
        assert max(overlaps([r for r in rows if r["grp"] == group])) == 1, group
    assert max(overlaps(rows)) >= 2  # different groups at once


async def test_messages_without_a_group_are_not_limited_per_group(
    dsn: str, db: asyncpg.Connection
) -> None:
    await send(dsn, [(Ping(n=n), None) for n in range(5)] + [(Ping(n=9), "g")])
    flow = FlowLimits.of([("test.Ping:h", Limits(group_concurrency=1), ["test.Ping"])], 10)
    assert flow is not None
    # One claim takes every ungrouped message and the one of group g.
    rows = await claim_limited(db, "nmbus", "billing", flow, 10, "w", 30.0, NO_FLOOR)
    assert len(rows) == 6
    await send(dsn, [(Ping(n=10), "g")])  # g has one running: held back
    assert await claim_limited(db, "nmbus", "billing", flow, 10, "w", 30.0, NO_FLOOR) == []


async def test_rate_holds_over_every_one_second_window_across_processes(
    dsn: str, log: asyncpg.Connection
) -> None:
    rate, total = 10, 35
    async with workers(dsn, rate=rate, sleep=0.0):
        await send(dsn, [(Ping(n=n), None) for n in range(total)])
        await wait_until(
            "SELECT count(*) FROM flow_log", db=log, until=lambda n: n == total, timeout=30
        )
    starts = [r["started"] for r in await log_rows(log)]
    worst = max(
        sum(1 for s in starts if start <= s < start + timedelta(seconds=1)) for start in starts
    )
    assert worst <= rate
    spread = (starts[-1] - starts[0]).total_seconds()
    # 35 starts at 10 a second: at least 3 whole windows apart, and not much more.
    assert 3.0 <= spread < 3.0 + 3.0, spread


async def rated_run(dsn: str, db: asyncpg.Connection, *, marks_land: bool) -> None:
    """Handle 40 messages under rate=1000 in a process kept busy; each flight's mark is
    never before its handler's real start (the marks that never land: the finish's)."""
    bus = Bus("billing", dsn=dsn, poll_interval=0.05, batch_size=20, handler_concurrency=2)
    started: dict[int, datetime] = {}

    @bus.handler(rate=1000.0)
    async def charge(msg: Ping, ctx: Context) -> None:
        started[ctx.message_id] = datetime.now(UTC)
        time.sleep(0.002)  # the process is busy: marks and the next starts wait
        await asyncio.sleep(0)

    async def busy() -> None:
        while True:
            time.sleep(0.03)  # another task holds the event loop now and then
            await asyncio.sleep(0.001)

    async with bus:
        if not marks_land:

            async def never(*args: object) -> None:
                await asyncio.Event().wait()

            bus.store.flow_started = never  # type: ignore[method-assign]
        hog = asyncio.create_task(busy())
        try:
            await send(dsn, [(Ping(n=n), None) for n in range(40)])
            await wait_until(lambda: len(started) == 40, timeout=30)
        finally:
            hog.cancel()
    marks = {r["id"]: r["started"] for r in await db.fetch('SELECT * FROM nmbus."flow$flights"')}
    assert sorted(marks) == sorted(started)
    late = [i for i, at in started.items() if marks[i] is None or marks[i] < at]
    assert late == [], "a start was marked before it happened, or never"


async def test_a_start_is_marked_only_after_its_handler_started(
    dsn: str, db: asyncpg.Connection
) -> None:
    await rated_run(dsn, db, marks_land=True)


async def test_the_finish_marks_a_start_whose_mark_did_not_land(
    dsn: str, db: asyncpg.Connection
) -> None:
    await rated_run(dsn, db, marks_land=False)


async def test_a_handler_with_a_rate_is_never_run_twice_after_a_rollback() -> None:
    bus = Bus("billing", store=MemoryStore())

    @bus.handler(rate=10.0, outside_effects=False)
    async def charge(msg: Ping, ctx: Context) -> None: ...

    assert not bus.registry.replayable(Ping) and not bus.registry.all_replayable


async def test_a_killed_worker_stops_counting_when_its_lease_runs_out(
    dsn: str, log: asyncpg.Connection
) -> None:
    async with workers(dsn, concurrency=1, sleep=3600, lease=2.0, processes=1) as (first,):
        await send(dsn, [(Ping(n=1), None), (Ping(n=2), None)])
        await first.wait_for("started")
        first.kill()  # SIGKILL, holding the one message the limit allows
    killed_at = datetime.now().astimezone()
    async with workers(dsn, concurrency=1, sleep=0.0, lease=2.0, processes=1):
        await wait_until("SELECT count(*) FROM flow_log", db=log, until=lambda n: n == 2)
    rows = await log_rows(log)
    # Nothing started before the dead worker's lease ran out.
    assert min(r["started"] for r in rows) >= killed_at + timedelta(seconds=0.5)


def test_bad_limits_are_refused_when_the_decorator_runs() -> None:
    bus = Bus("billing", store=MemoryStore())
    for bad in (
        {"concurrency": 0},
        {"concurrency": -1},
        {"concurrency": True},
        {"concurrency": 1.5},
        {"group_concurrency": 0},
        {"rate": 0},
        {"rate": -5.0},
        {"rate": math.inf},
        {"rate": math.nan},
        {"rate": "100"},
        {"rate": 1e-12},  # less than one start a day
    ):
        with pytest.raises(HandlerError):

            @bus.handler(**bad)  # type: ignore[arg-type]
            async def handle(msg: Ping, ctx: Context) -> None: ...


def test_two_limited_handlers_counted_under_one_name_are_refused() -> None:
    bus = Bus("billing", store=MemoryStore())

    def make() -> None:
        @bus.handler(concurrency=1)
        async def charge(msg: Ping, ctx: Context) -> None: ...

    make()
    with pytest.raises(HandlerError, match="own name"):
        make()


async def test_a_big_limited_backlog_never_holds_other_types_back(
    dsn: str, log: asyncpg.Connection
) -> None:
    # Room left (10 > one loop running one at a time): the limited backlog is not
    # held back, yet it must not fill the batches ahead of other types.
    async with workers(dsn, concurrency=10, sleep=0.5, processes=1, loops=1):
        await send(dsn, [(Ping(n=n), None) for n in range(30)])
        await send(dsn, [(Pong(n=n), None) for n in range(5)])
        await wait_until(
            "SELECT count(*) FROM flow_log WHERE kind = 'pong'", db=log, until=lambda n: n == 5
        )
        assert len(await log_rows(log)) < 10


async def test_bad_groups_are_refused_before_anything_is_written(dsn: str) -> None:
    async with Bus("shop", dsn=dsn, concurrency=0, create_queues=True) as sender:
        for bad in ("", "g" * 201, "é" * 101, 42, "a\x00b"):
            with pytest.raises(InvalidMessage):
                await sender.send(Ping(n=1), to="billing", group=bad)  # type: ignore[arg-type]
        await sender.send(Ping(n=1), to="billing", group="é" * 100)  # 200 bytes: fine
        with pytest.raises(InvalidMessage):
            await sender.send(Ping(n=1), to="billing", headers={"nmbus-group": "x"})


async def test_the_in_memory_store_says_limits_need_postgresql() -> None:
    bus = Bus("billing", store=MemoryStore())

    @bus.handler(concurrency=2)
    async def handle(msg: Ping, ctx: Context) -> None: ...

    with pytest.raises(ConfigurationError, match="PostgreSQL"):
        async with bus:
            pass


async def test_ctx_group_is_the_group_sent(dsn: str) -> None:
    seen: list[str | None] = []
    bus = Bus("billing", dsn=dsn, poll_interval=0.1)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        seen.append(ctx.group)

    async with bus:
        await send(dsn, [(Ping(n=1), "tenant-42"), (Ping(n=2), None)])
        await wait_until(lambda: len(seen) == 2, timeout=10)
    assert sorted(seen, key=str) == [None, "tenant-42"]


async def test_a_handler_sends_with_a_group_as_the_bus_does(dsn: str) -> None:
    """ctx.send takes the options Bus.send takes (one SendOptions): group included."""
    seen: list[tuple[int, str | None]] = []
    refused: list[str] = []
    bus = Bus("billing", dsn=dsn, poll_interval=0.1)

    @bus.handler
    async def forward(msg: Ping, ctx: Context) -> None:
        try:
            await ctx.send(Pong(n=msg.n), to="billing", grup="typo")  # type: ignore[call-arg]
        except TypeError as e:
            refused.append(str(e))
        await ctx.send(Pong(n=msg.n), to="billing", group=f"tenant-{msg.n}")

    @bus.handler
    async def handle(msg: Pong, ctx: Context) -> None:
        seen.append((msg.n, ctx.group))

    async with bus:
        with pytest.raises(TypeError, match="grup"):
            await bus.send(Ping(n=0), to="billing", grup="typo")  # type: ignore[call-arg]
        await bus.send(Ping(n=1), to="billing")
        await wait_until(lambda: len(seen) == 1, timeout=10)
    assert seen == [(1, "tenant-1")]
    assert refused == ["send() got an unexpected keyword argument 'grup'"]


async def test_limits_declared_differently_by_two_processes_are_said_once(dsn: str) -> None:
    def endpoint(concurrency: int) -> Bus:
        bus = Bus("billing", dsn=dsn, poll_interval=0.1)

        @bus.handler(concurrency=concurrency)
        async def charge(msg: Ping, ctx: Context) -> None: ...

        return bus

    async with endpoint(2):
        with capture_logs() as logs:
            async with endpoint(3):
                pass
    warned = [e for e in logs if e["event"] == "flow_limits_differ"]
    assert len(warned) == 1
    assert warned[0]["declared"] == "concurrency=3" and warned[0]["other"] == "concurrency=2"
    with capture_logs() as logs:
        async with endpoint(3):  # the same as last declared: nothing to say
            pass
    assert not [e for e in logs if e["event"] == "flow_limits_differ"]


async def nmbus_status(dsn: str) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "nmbus", "status", "--dsn", dsn, "--json",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    found: dict[str, Any] = json.loads(out)
    return found


async def test_status_admin_and_cookbook_show_what_limits_hold_back(
    dsn: str, log: asyncpg.Connection
) -> None:
    async with workers(dsn, concurrency=1, sleep=3600, processes=1) as (worker,):
        await send(dsn, [(Ping(n=n), None) for n in range(4)])
        await worker.wait_for("started")
        await asyncio.sleep(0.3)
        (row,) = await psql(dsn, "held_back.sql", queue="billing")
        async with Admin(dsn) as admin:
            (limit,) = await admin.flow_status()
            assert await admin.flow_status(["shop"]) == []
        status = await nmbus_status(dsn)
    assert row["handler"] == limit.handler == "test.Ping:main.<locals>.on_ping"
    assert row["limits"] == limit.limits == "concurrency=1"
    assert (row["in_flight"], row["ready_waiting"]) == ("1", "3")
    assert int(row["started_last_second"]) <= 1
    assert (limit.queue, limit.in_flight, limit.started, limit.waiting) == ("billing", 1, None, 3)
    assert limit.held_back == 3  # no room: every waiting one is held back
    (shown,) = status["limits"]
    assert (shown["handler"], shown["in_flight"], shown["held_back"]) == (limit.handler, 1, 3)


async def test_status_counts_only_the_groups_at_their_limit_as_held_back(
    dsn: str, log: asyncpg.Connection
) -> None:
    async with workers(dsn, group_concurrency=1, rate=1000, sleep=3600, processes=1) as (w,):
        await send(dsn, [(Ping(n=1), "a"), (Ping(n=2), "a")])
        await w.wait_for("started")
        # Sent once a's first runs: claimed with it, b's would wait behind it in
        # its batch (handlers of a batch run one after another), not for a limit.
        await send(dsn, [(Ping(n=3), "b")])
        await w.wait_for("started")
        async with Admin(dsn) as admin:
            (limit,) = await admin.flow_status(["billing"])
    # a and b each run one; the second of a waits for its group, and only it.
    assert (limit.in_flight, limit.started, limit.waiting, limit.held_back) == (2, 2, 1, 1)


async def test_groups_are_served_in_turn_so_a_backlog_never_holds_another_group_back(
    dsn: str, db: asyncpg.Connection
) -> None:
    order: list[str | None] = []
    bus = Bus("billing", dsn=dsn, poll_interval=0.1, batch_size=10)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        order.append(ctx.group)

    # The big tenant's backlog first, then two small tenants.
    await send(dsn, [(Ping(n=n), "big") for n in range(300)])
    await send(dsn, [(Ping(n=n), f"small-{n % 2}") for n in range(4)])
    async with bus:
        await wait_until(lambda: len(order) == 304, timeout=30)
    last_small = max(i for i, g in enumerate(order) if g and g.startswith("small"))
    # Each claim of 10 takes the first message of every group first: the small
    # tenants' 4 are done within the first 2 batches, not after the 300.
    assert last_small < 20, order[:40]
    assert order.count("big") == 300
