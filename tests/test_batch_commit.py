"""batch_commit_interval: a batch of slow handlers commits what is done as it goes.

What a handler sent, and its message's outcome, must not wait for the slowest
handler of its batch. Each test lets a handler wait (up to a generous cap) for
what its batch-mates did to become visible from another connection, so none
depends on how fast the machine is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import asyncpg
from pydantic import BaseModel

from nmbus import Bus, Context, Message
from nmbus.postgres.sagas import _lock_id
from nmbus.testing import drain
from tests.messages import Ping, Pong
from tests.waits import wait_until

CAP = 20.0


async def visible(db: asyncpg.Connection, sql: str, want: int) -> bool:
    """Whether ``sql`` counts ``want`` rows within CAP seconds, from the test's connection."""
    try:
        await wait_until(sql, db=db, until=lambda n: n >= want, timeout=CAP, interval=0.02)
    except AssertionError:  # not within CAP
        return False
    return True


async def send_pings(make_bus: Callable[..., Bus], count: int) -> None:
    """``count`` pings waiting in billing's queue (every queue created by its endpoint)."""
    async with (
        make_bus("billing", concurrency=0),
        make_bus("audit", concurrency=0),
        make_bus("orders", concurrency=0) as sender,
    ):
        for n in range(count):
            await sender.send(Ping(n=n), to="billing")


async def test_concurrent_batch_mates_are_committed_while_a_slow_handler_runs(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", batch_size=10, handler_concurrency=5)
    seen: list[bool] = []

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        if msg.n == 0:
            # The slow one: its four batch-mates, and what they sent, commit before it ends.
            done = await visible(
                db, "SELECT count(*) FROM nmbus.billing WHERE subqueue = 'X'", 4
            ) and await visible(db, "SELECT count(*) FROM nmbus.audit", 4)
            seen.append(done)
            return
        await ctx.send(Pong(n=msg.n), to="audit")

    await send_pings(make_bus, 5)
    async with bus:
        await drain(bus, timeout=CAP + 10)
    assert seen == [True]
    states = await db.fetch("SELECT subqueue, retry_count FROM nmbus.billing")
    assert [(r["subqueue"], r["retry_count"]) for r in states] == [("X", 1)] * 5
    assert await db.fetchval("SELECT count(*) FROM nmbus.audit") == 4


async def test_one_handler_at_a_time_commits_what_came_before_a_long_one(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # The default interval (0.5 s) has passed when the first handler returns: its
    # send and outcome commit before the second message is handled.
    bus = make_bus("billing", batch_size=10)
    assert bus.settings.batch_commit_interval < 0.6
    seen: list[bool] = []

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        if msg.n == 0:
            await asyncio.sleep(0.6)
            await ctx.send(Pong(n=0), to="audit")
        else:
            seen.append(await visible(db, "SELECT count(*) FROM nmbus.audit", 1))

    await send_pings(make_bus, 2)
    async with bus:
        await drain(bus, timeout=CAP + 10)
    assert seen == [True]
    states = await db.fetch("SELECT subqueue, retry_count FROM nmbus.billing ORDER BY id")
    assert [(r["subqueue"], r["retry_count"]) for r in states] == [("X", 1)] * 2


async def test_a_committed_part_is_not_run_again_when_the_rest_of_its_batch_fails(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # A deferred constraint fails the batch at its last COMMIT; the batch is then
    # tried a message at a time, but only what no earlier part committed: here
    # the failing message alone, whose attempt is recorded as failed.
    await db.execute("CREATE TABLE once (n int UNIQUE DEFERRABLE INITIALLY DEFERRED)")
    await db.execute("INSERT INTO once VALUES (1)")
    bus = make_bus("billing", batch_size=10, max_attempts=3, retry_delay=60)
    runs: list[int] = []

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        runs.append(msg.n)
        if msg.n == 0:
            await asyncio.sleep(0.6)
            await ctx.connection.execute("INSERT INTO once VALUES (0)")
        else:
            await ctx.connection.execute("INSERT INTO once VALUES ($1)", msg.n)

    await send_pings(make_bus, 2)
    async with bus:
        await drain(bus, timeout=CAP)
    first, second = await db.fetch(
        "SELECT subqueue, retry_count, error_info FROM nmbus.billing ORDER BY id"
    )
    assert (first["subqueue"], first["retry_count"]) == ("X", 1)
    assert (second["subqueue"], second["retry_count"]) == ("R", 1)
    assert second["error_info"].startswith("OutcomeNotRecorded: batch transaction")
    assert runs == [0, 1]  # the second alone would have been [0, 1, 0, 1]
    assert await db.fetchval("SELECT count(*) FROM once WHERE n = 0") == 1


async def test_stopping_during_a_batch_keeps_its_committed_part_and_gives_back_the_rest(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", batch_size=40)
    ran: list[int] = []

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        ran.append(msg.n)
        await asyncio.sleep(0.2)

    await send_pings(make_bus, 40)
    async with bus:
        # Stop once a part is committed, while the batch still has messages to go.
        assert await visible(db, "SELECT count(*) FROM nmbus.billing WHERE subqueue = 'X'", 1)
    rows = await db.fetch("SELECT msg_text, subqueue, retry_count FROM nmbus.billing ORDER BY id")
    ends = [(r["subqueue"], r["retry_count"]) for r in rows]
    # Each message handled once and X, or never started and given back with no attempt.
    assert sorted(ran) == ran == list(range(len(ran)))
    assert ends == [("X", 1)] * len(ran) + [("I", 0)] * (40 - len(ran))
    assert len(ran) < 40  # 8 s of handlers; the stop came a part (0.5 s) in


class Step(Message, type_name="test.batch_commit.Step"):
    key: str
    slow: bool = False


class Tally(BaseModel):
    n: int = 0


async def test_a_committed_part_is_counted_when_the_rest_of_its_batch_fails_after_it(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str
) -> None:
    # After a part commits, the rest of a saga batch takes its saga locks again;
    # here that fails (another session holds the lock past lock_timeout). The
    # committed part stays X and the rest is recorded failed: both are counted.
    name = await db.fetchval("SELECT current_database()")
    await db.execute(f"ALTER DATABASE \"{name}\" SET lock_timeout = '300ms'")
    bus = make_bus("acct", concurrency=0, batch_commit_interval=0.05, retry_delay=60)
    saga = bus.saga(Tally, key="key")
    other = await asyncpg.connect(dsn)
    await other.execute("SET lock_timeout = 0")
    first = _lock_id(f"nmbus.acct$saga/{saga.name}")
    waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
    taken: list[asyncio.Task[str]] = []

    @saga.handler(start=True)
    async def step(msg: Step, state: Tally, ctx: Context) -> None:
        state.n += 1
        if msg.slow:
            # Queue up for b's lock, which this batch holds until its part commits.
            lock = other.execute("SELECT pg_advisory_lock($1, $2)", first, _lock_id("b"))
            taken.append(asyncio.create_task(lock))
            assert await visible(db, waiting, 1)
            await asyncio.sleep(0.1)

    try:
        async with make_bus("sender", concurrency=0) as sender, bus:
            await sender.send(Step(key="a", slow=True), to="acct")
            await sender.send(Step(key="b"), to="acct")
            counts = await bus.worker.run_burst()
        await asyncio.gather(*taken)
    finally:
        await other.close()
    rows = await db.fetch("SELECT subqueue, error_info FROM nmbus.acct ORDER BY id")
    assert [r["subqueue"] for r in rows] == ["X", "R"]
    assert "lock timeout" in rows[1]["error_info"]
    assert counts == {"X": 1, "R": 1, "F": 0}
    assert bus.worker.handled == 2


async def test_a_part_that_lost_a_lease_gives_the_rest_of_its_batch_back_at_once(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str
) -> None:
    # Another worker took the first message over (as after its lease ran out) while
    # it ran: its part rolls back. The rest of the batch, never started, goes back
    # at once with no attempt counted, not as crash suspects a whole lease later.
    bus = make_bus("billing", batch_size=10, batch_commit_interval=0.05, lease_seconds=60)
    runs: list[tuple[int, int]] = []
    # The other worker's own connection: the test polls ``db`` while the handler runs.
    other = await asyncpg.connect(dsn)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        runs.append((msg.n, ctx.retry_count))
        await ctx.send(Pong(n=msg.n), to="audit")
        if msg.n == 0 and ctx.retry_count == 1:
            taken = "UPDATE nmbus.billing SET handling_client_id = 'other' WHERE id = $1"
            await other.execute(taken, ctx.message_id)
            await asyncio.sleep(0.1)

    await send_pings(make_bus, 5)
    try:
        async with bus:
            rest = "SELECT count(*) FROM nmbus.billing WHERE id > 1 AND subqueue = 'X'"
            assert await visible(db, rest, 4)
            # The other worker gives its row back (as abandon_leases does).
            back = "UPDATE nmbus.billing SET handling_client_id = NULL, lease_expires = NULL"
            await db.execute(f"{back} WHERE id = 1")
            await drain(bus, timeout=CAP)
    finally:
        await other.close()
    rows = await db.fetch("SELECT subqueue, retry_count, isolated FROM nmbus.billing ORDER BY id")
    assert [tuple(r) for r in rows] == [("X", 2, False)] + [("X", 1, False)] * 4
    assert sorted(runs) == [(0, 1), (0, 2), (1, 1), (2, 1), (3, 1), (4, 1)]
