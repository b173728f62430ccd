"""The worker's fast paths keep the semantics of the slow ones.

A handler that never waits runs without a timer; one that waits runs under its
timeout. A batch that writes nothing commits its finish by itself and claims
the next batch in the same statement; losing a lease there is logged, not
retried.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import asyncpg
import structlog

from nmbus import Bus, Context
from nmbus.testing import drain
from tests.messages import Ping
from tests.waits import wait_until


async def test_waiting_and_non_waiting_handlers_succeed_fail_and_time_out(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", max_attempts=1)
    seen: list[int] = []

    @bus.handler(timeout=0.3)
    async def handle(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)
        if msg.n == 1:
            raise ValueError("raised before any await")
        if msg.n >= 2:
            await asyncio.sleep(0)  # the handler now waits at least once
        if msg.n == 3:
            raise KeyError("raised after an await")
        if msg.n == 4:
            await asyncio.sleep(30)  # past its timeout

    async with bus:
        for n in range(5):
            await bus.send(Ping(n=n), to="billing")
        await drain(bus, timeout=30)
    rows = await db.fetch('SELECT msg_text, subqueue, error_info FROM nmbus."billing" ORDER BY id')
    by_n = {int(r["msg_text"].split(":")[1].rstrip("}")): r for r in rows}
    assert sorted(seen) == [0, 1, 2, 3, 4]
    assert [by_n[n]["subqueue"] for n in range(5)] == ["X", "F", "X", "F", "F"]
    assert by_n[1]["error_info"].startswith("ValueError: raised before any await")
    assert by_n[3]["error_info"].startswith("KeyError: 'raised after an await'")
    assert by_n[4]["error_info"].startswith("HandlerTimeout")


async def test_batches_follow_one_another_and_each_message_runs_once(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", batch_size=7)
    seen: list[int] = []

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)
        if msg.n % 10 == 0:  # some batches write, most do not
            await ctx.connection.execute("SELECT 1")

    async with Bus("sender", dsn=bus.settings.dsn, concurrency=0) as sender:
        for n in range(50):
            await sender.send(Ping(n=n), to="billing")
    async with bus:
        await drain(bus, timeout=30)
    assert sorted(seen) == list(range(50))
    counts = await db.fetch(
        "SELECT subqueue, retry_count, handling_client_id IS NULL AS free, count(*) "
        'FROM nmbus."billing" GROUP BY 1, 2, 3'
    )
    assert [tuple(r) for r in counts] == [("X", 1, True, 50)]


async def test_a_lease_lost_in_a_batch_that_wrote_nothing_is_logged_not_rerun(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str
) -> None:
    bus = make_bus("billing", batch_size=10)
    seen: list[int] = []
    thief = await asyncpg.connect(dsn)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)
        if msg.n == 2:
            # Another worker takes this row over, as if our lease had run out.
            await thief.execute(
                'UPDATE nmbus."billing" SET handling_client_id = $2 WHERE id = $1',
                ctx.message_id,
                "thief",
            )

    try:
        async with Bus("sender", dsn=dsn, concurrency=0) as sender:
            for n in range(5):
                await sender.send(Ping(n=n), to="billing")
        with structlog.testing.capture_logs() as logs:
            async with bus:
                await wait_until(
                    lambda: (len(seen), len(bus.worker.in_flight)),
                    until=lambda state: state[0] >= 5 and state[1] == 0,
                    what="(messages seen, in flight) to be (5, 0)",
                )
                await asyncio.sleep(0.2)
    finally:
        await thief.close()
    assert sorted(seen) == [0, 1, 2, 3, 4]  # nobody ran twice
    lost = [e for e in logs if e["event"] == "lease_lost"]
    assert len(lost) == 1 and lost[0]["messages"] == 1
    rows = await db.fetch('SELECT subqueue, handling_client_id FROM nmbus."billing" ORDER BY id')
    assert [tuple(r) for r in rows] == [
        ("X", None),
        ("X", None),
        ("I", "thief"),
        ("X", None),
        ("X", None),
    ]


async def test_savepoints_released_late_still_undo_only_the_failing_handler(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    await db.execute("CREATE TABLE effects (n int PRIMARY KEY)")
    bus = make_bus("billing", batch_size=20, max_attempts=1)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        await ctx.connection.execute("INSERT INTO effects (n) VALUES ($1)", msg.n)
        if msg.n % 4 == 1:
            raise ValueError("fails after its write")
        if msg.n % 4 == 2:
            # A statement fails and the handler swallows it: this handler fails,
            # not the next one and not the batch.
            with contextlib.suppress(asyncpg.UniqueViolationError):
                await ctx.connection.execute("INSERT INTO effects (n) VALUES ($1)", msg.n)

    async with Bus("sender", dsn=bus.settings.dsn, concurrency=0) as sender:
        for n in range(12):
            await sender.send(Ping(n=n), to="billing")
    async with bus:
        await drain(bus, timeout=30)
    effects = [r["n"] for r in await db.fetch("SELECT n FROM effects ORDER BY n")]
    assert effects == [n for n in range(12) if n % 4 in (0, 3)]
    states = await db.fetch('SELECT subqueue, error_info FROM nmbus."billing" ORDER BY id')
    assert [r["subqueue"] for r in states] == ["X", "F", "F", "X"] * 3
    assert "InFailedSQLTransaction" in states[2]["error_info"]
