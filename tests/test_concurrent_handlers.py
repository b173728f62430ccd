"""handler_concurrency: handlers of one batch run at once, acks still in one finish."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import asyncpg

from nmbus import Bus, Context
from nmbus.testing import drain
from tests.messages import Event, Ping


async def test_waiting_handlers_of_a_batch_overlap_and_all_finish(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", batch_size=20, handler_concurrency=8)
    running = 0
    most = 0
    seen: list[int] = []

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.05)  # a network call, say
        running -= 1
        seen.append(msg.n)

    async with Bus("sender", dsn=bus.settings.dsn, concurrency=0) as sender:
        for n in range(20):
            await sender.send(Ping(n=n), to="billing")
    async with bus:
        await drain(bus, timeout=30)
    assert sorted(seen) == list(range(20))
    assert 2 <= most <= 8
    states = await db.fetch('SELECT subqueue, retry_count FROM nmbus."billing"')
    assert {(r["subqueue"], r["retry_count"]) for r in states} == {("X", 1)}


async def test_concurrent_handlers_take_turns_on_the_connection_and_fail_alone(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    await db.execute("CREATE TABLE effects (n int PRIMARY KEY)")
    bus = make_bus("billing", batch_size=30, handler_concurrency=10, max_attempts=1)
    bus.subscribe(Event, publisher="billing")

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        await asyncio.sleep(0.01 * (msg.n % 3))
        await ctx.connection.execute("INSERT INTO effects (n) VALUES ($1)", msg.n)
        await asyncio.sleep(0.01)  # still holding its savepoint while it waits
        await ctx.connection.execute("SELECT pg_sleep(0.001)")
        if msg.n % 5 == 0:
            await ctx.publish(Event(name=str(msg.n)))
        if msg.n % 7 == 3:
            raise ValueError("fails after its writes")

    @bus.handler
    async def on_event(msg: Event, ctx: Context) -> None:
        await ctx.connection.execute("INSERT INTO effects (n) VALUES ($1)", 1000 + int(msg.name))

    async with Bus("sender", dsn=bus.settings.dsn, concurrency=0) as sender:
        for n in range(30):
            await sender.send(Ping(n=n), to="billing")
    async with bus:
        await drain(bus, timeout=30)
    effects = {r["n"] for r in await db.fetch("SELECT n FROM effects")}
    expected = {n for n in range(30) if n % 7 != 3}
    assert {n for n in effects if n < 1000} == expected
    pings = await db.fetch(
        "SELECT msg_text, subqueue FROM nmbus.\"billing\" WHERE label = 'test.Ping'"
    )
    failed = sorted(
        int(r["msg_text"].split(":")[1].rstrip("}")) for r in pings if r["subqueue"] == "F"
    )
    assert failed == [n for n in range(30) if n % 7 == 3]
    events = await db.fetch("SELECT subqueue FROM nmbus.\"billing\" WHERE label = 'test.Event'")
    assert len(events) == len([n for n in range(30) if n % 5 == 0 and n % 7 != 3])
    assert {r["subqueue"] for r in events} == {"X"}
    assert {n - 1000 for n in effects if n >= 1000} == {
        n for n in range(30) if n % 5 == 0 and n % 7 != 3
    }
