"""Cancellation: a message that has not started never runs (DESIGN.md section 10)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from nmbus import Bus, Context
from nmbus.errors import InvalidMessage, InvalidQueueName, QueueNotFound
from nmbus.ops.admin import Admin
from nmbus.testing import MemoryStore
from tests.messages import Ping
from tests.waits import wait_until

ROWS = "SELECT subqueue, error_info FROM nmbus.billing WHERE unique_id = $1"


@pytest.fixture
async def sender(dsn: str) -> AsyncIterator[Bus]:
    async with Bus("shop", dsn=dsn, concurrency=0, create_queues=True) as bus:
        yield bus


async def test_a_waiting_message_cancelled_by_unique_id_never_runs_and_can_be_requeued(
    dsn: str, db: asyncpg.Connection, sender: Bus
) -> None:
    await sender.send(Ping(n=1), to="billing", unique_id="order-7")
    await sender.send(Ping(n=2), to="billing", unique_id="later", delay=3600)  # R
    assert await sender.cancel("billing", unique_id="order-7") == 1
    assert await sender.cancel("billing", unique_id="order-7") == 0  # already cancelled
    assert await sender.cancel("billing", unique_id="later") == 1  # scheduled: not started
    assert await sender.cancel("billing", unique_id="no-such") == 0
    subqueue, error = await db.fetchrow(ROWS, "order-7")
    assert subqueue == "F" and error.startswith("Cancelled") and "order-7" in error

    handled: list[int] = []
    worker = Bus("billing", dsn=dsn, poll_interval=0.1)

    @worker.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        handled.append(msg.n)

    async with worker:
        await asyncio.sleep(0.5)
        assert handled == []
        async with Admin(dsn) as admin:
            assert await admin.requeue_failed("billing", every=True) == 2
        await wait_until(lambda: sorted(handled) == [1, 2], timeout=10)


async def test_running_and_done_messages_are_left_alone_and_not_counted(
    dsn: str, db: asyncpg.Connection, sender: Bus
) -> None:
    started: list[int] = []
    release = asyncio.Event()
    # One loop, one message a claim: the messages behind a running one wait for it.
    worker = Bus("billing", dsn=dsn, poll_interval=0.1, batch_size=1, concurrency=1)

    @worker.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        started.append(msg.n)
        if msg.n == 1:
            await release.wait()

    async with worker:
        await sender.send(Ping(n=0), to="billing", correlation_id="checkout-9")
        await wait_until(lambda: started == [0], timeout=10)
        await wait_until("SELECT count(*) FROM nmbus.billing WHERE subqueue = 'X'", db=db)
        await sender.send(Ping(n=1), to="billing", correlation_id="checkout-9")
        await wait_until(lambda: started == [0, 1], timeout=10)  # running now
        for n in (2, 3):  # waiting behind it: the worker runs one at a time
            await sender.send(Ping(n=n), to="billing", correlation_id="checkout-9")
        await sender.send(Ping(n=4), to="billing", correlation_id="other")
        assert await sender.cancel("billing", correlation_id="checkout-9") == 2
        release.set()
        await wait_until(lambda: started == [0, 1, 4], timeout=10)
    rows = await db.fetch(
        "SELECT msg_text::jsonb->>'n' AS n, subqueue, error_info FROM nmbus.billing ORDER BY id"
    )
    assert [(r["n"], r["subqueue"]) for r in rows] == [
        ("0", "X"),
        ("1", "X"),
        ("2", "F"),
        ("3", "F"),
        ("4", "X"),
    ]
    assert all(r["error_info"].startswith("Cancelled") for r in rows if r["subqueue"] == "F")


async def test_a_cancel_racing_the_claims_either_cancels_a_message_or_lets_it_run(
    dsn: str, db: asyncpg.Connection, sender: Bus
) -> None:
    total = 3000
    handled: list[int] = []
    worker = Bus("billing", dsn=dsn, poll_interval=0.05, batch_size=20, concurrency=2)

    @worker.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        handled.append(msg.n)

    await sender.send(Ping(n=-1), to="billing")  # creates the queue
    for start in range(0, total, 500):
        async with sender.store.pool.acquire() as conn, conn.transaction():  # type: ignore[attr-defined]
            for n in range(start, start + 500):
                await sender.send(
                    Ping(n=n),
                    to="billing",
                    unique_id=f"m{n}",
                    correlation_id=f"c{n % 7}",
                    connection=conn,
                )
    cancelled = 0
    async with worker:
        await wait_until(lambda: len(handled) > 50, timeout=10)
        for n in range(total - 1, -1, -3):  # from the end, toward the claims
            cancelled += await sender.cancel("billing", unique_id=f"m{n}")
        cancelled += await sender.cancel("billing", correlation_id="c3")
        await wait_until(
            "SELECT count(*) FROM nmbus.billing WHERE subqueue IN ('I', 'R')",
            db=db,
            until=lambda n: n == 0,
        )
    failed = {
        int(r[0])
        for r in await db.fetch(
            "SELECT msg_text::jsonb->>'n' FROM nmbus.billing WHERE subqueue = 'F' "
            "AND error_info LIKE 'Cancelled%'"
        )
    }
    ran = [n for n in handled if n >= 0]
    assert len(ran) == len(set(ran))  # none ran twice
    assert not failed & set(ran)  # never both
    assert failed | set(ran) == set(range(total))  # never neither
    assert len(failed) == cancelled > 0


async def test_bad_requests_are_refused_before_anything_is_touched(dsn: str, sender: Bus) -> None:
    await sender.send(Ping(n=1), to="billing", unique_id="k")
    with pytest.raises(ValueError, match="exactly one"):
        await sender.cancel("billing")
    with pytest.raises(ValueError, match="exactly one"):
        await sender.cancel("billing", unique_id="k", correlation_id="c")
    with pytest.raises(InvalidMessage, match="bytes"):
        await sender.cancel("billing", unique_id="é" * 600)
    with pytest.raises(InvalidMessage, match="non-empty"):
        await sender.cancel("billing", correlation_id="")
    with pytest.raises(InvalidMessage):
        await sender.cancel("billing", unique_id=7)  # type: ignore[arg-type]
    with pytest.raises(InvalidQueueName):
        await sender.cancel('billing"; DROP TABLE nmbus.billing; --', unique_id="k")
    with pytest.raises(QueueNotFound):
        await sender.cancel("nosuch", unique_id="k")
    with pytest.raises(QueueNotFound):
        await sender.cancel("nosuch", correlation_id="c")
    async with Admin(dsn) as admin:
        with pytest.raises(QueueNotFound):
            await admin.cancel("nosuch", unique_id="k")
        assert await admin.cancel("billing", unique_id="k") == 1


async def test_the_memory_store_cancels_as_postgresql_does() -> None:
    store = MemoryStore()
    async with Bus("shop", store=store, concurrency=0) as bus:
        await bus.send(Ping(n=1), to="billing", unique_id="a", correlation_id="c")
        await bus.send(Ping(n=2), to="billing", unique_id="b", correlation_id="c")
        assert await bus.cancel("billing", unique_id="a") == 1
        assert await bus.cancel("billing", correlation_id="c") == 1
        assert await bus.cancel("billing", correlation_id="c") == 0
        rows = store.rows("billing")
        assert {r.subqueue for r in rows} == {"F"}
        assert all(r.error_info and r.error_info.startswith("Cancelled") for r in rows)
        with pytest.raises(QueueNotFound):
            await bus.cancel("nosuch", unique_id="a")
