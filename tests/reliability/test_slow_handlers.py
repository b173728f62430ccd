"""Slow and hung handlers, and a send pool that is exhausted while they run."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta

import asyncpg
import pytest

from nmbus import Bus, Context
from nmbus.testing import drain
from tests.messages import Ping, Slow
from tests.waits import wait_until

pytestmark = pytest.mark.reliability


async def _wait_for_row(db: asyncpg.Connection, subqueue: str) -> None:
    await wait_until("SELECT subqueue FROM nmbus.billing", db=db, until=lambda s: s == subqueue)


async def _outlive_leases(db: asyncpg.Connection, leases: int) -> None:
    """Wait until the one row's lease was renewed ``leases`` leases (of 1 s) past its first."""
    first = await db.fetchval("SELECT lease_expires FROM nmbus.billing")
    await wait_until(
        "SELECT lease_expires FROM nmbus.billing",
        db=db,
        until=lambda expires: expires is not None and expires >= first + timedelta(seconds=leases),
        what=f"the lease renewed {leases} leases past {first}",
    )


def _rival(make_bus: Callable[..., Bus], runs: list[str]) -> Bus:
    """A second worker on the same queue, polling hard, that would steal an expired lease."""
    rival = make_bus("billing", lease_seconds=1.0, poll_interval=0.1)

    @rival.handler
    async def steal(msg: Slow, ctx: Context) -> None:
        runs.append("rival")

    return rival


async def test_a_handler_running_for_many_leases_keeps_its_message(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", lease_seconds=1.0, handler_timeout=30)
    runs: list[str] = []
    started, outlived = asyncio.Event(), asyncio.Event()

    @bus.handler
    async def slow(msg: Slow, ctx: Context) -> None:
        runs.append("owner")
        started.set()
        await outlived.wait()

    async with bus:
        await bus.send(Slow(n=1), to="billing")
        await asyncio.wait_for(started.wait(), 10)
        async with _rival(make_bus, runs):
            await _outlive_leases(db, 3)  # its first lease long run out, the rival polling
            outlived.set()
            await _wait_for_row(db, "X")
    assert runs == ["owner"]
    row = await db.fetchrow("SELECT * FROM nmbus.billing")
    assert row["retry_count"] == 1 and row["handling_client_id"] is None


async def test_lease_renewal_survives_an_exhausted_send_pool(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", lease_seconds=1.0, send_pool_size=1, handler_timeout=30)
    runs: list[str] = []
    started, outlived = asyncio.Event(), asyncio.Event()

    @bus.handler
    async def slow(msg: Slow, ctx: Context) -> None:
        runs.append("owner")
        started.set()
        await outlived.wait()

    async with bus:
        await bus.store.ensure_queue("audit")
        await bus.send(Slow(n=1), to="billing")
        await asyncio.wait_for(started.wait(), 10)
        async with _rival(make_bus, runs):
            # The application holds the bus's only pooled connection in a long
            # outbox transaction while many sends queue up behind it.
            pool = bus.store.pool  # type: ignore[attr-defined]
            async with pool.acquire() as conn, conn.transaction():
                await bus.send(Ping(n=0), to="audit", connection=conn)
                waiting = [
                    asyncio.create_task(bus.send(Ping(n=n), to="audit")) for n in range(1, 50)
                ]
                await _outlive_leases(db, 3)  # renewed while the pool is held
            outlived.set()
            await asyncio.gather(*waiting)
            await _wait_for_row(db, "X")
    assert runs == ["owner"]
    assert await db.fetchval("SELECT count(*) FROM nmbus.audit") == 50


async def test_a_hung_handler_is_cancelled_at_its_timeout_and_retried(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", handler_timeout=0.5, retry_delay=0.1, lease_seconds=5.0)
    attempts: list[int] = []
    cancelled: list[int] = []

    @bus.handler
    async def hangs_once(msg: Slow, ctx: Context) -> None:
        attempts.append(ctx.retry_count)
        if ctx.retry_count == 1:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(ctx.retry_count)
                raise

    @bus.handler
    async def fast(msg: Ping, ctx: Context) -> None:
        attempts.append(-msg.n)

    async with bus:
        await bus.send(Slow(n=1), to="billing")
        await bus.send(Ping(n=7), to="billing")
        await wait_until(
            "SELECT count(*) FROM nmbus.billing WHERE subqueue = 'X'",
            db=db,
            until=lambda done: done >= 2,
            timeout=20,
        )
        await drain(bus)
    assert cancelled == [1]
    assert sorted(attempts) == [-7, 1, 2]
    slow = await db.fetchrow("SELECT * FROM nmbus.billing WHERE label = 'test.Slow'")
    assert slow["subqueue"] == "X" and slow["retry_count"] == 2
    assert slow["error_info"].startswith("HandlerTimeout: the handler did not finish")


async def test_a_handler_that_always_hangs_ends_in_f(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", handler_timeout=0.3, retry_delay=0.05, max_attempts=3)

    @bus.handler
    async def hangs(msg: Slow, ctx: Context) -> None:
        await asyncio.sleep(3600)

    async with bus:
        await bus.send(Slow(n=1), to="billing")
        await _wait_for_row(db, "F")
    row = await db.fetchrow("SELECT * FROM nmbus.billing")
    assert row["retry_count"] == 3
    assert row["error_info"].startswith("HandlerTimeout")
