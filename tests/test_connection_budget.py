"""The connections of an endpoint process: what each is for, how many, and those shared.

docs/deployment.md, "Connection budget": an endpoint process holds up to
``send_pool_size`` pooled connections, one per worker loop, one LISTEN and one
for its leases, each named in ``pg_stat_activity``; several endpoints of one
process on one DSN share the pool and the listener.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from contextlib import AsyncExitStack

import asyncpg
import pytest

from nmbus import Bus, Context
from nmbus.errors import ConfigurationError
from tests.messages import Ping
from tests.waits import wait_until

ENDPOINTS = ("billing", "shipping", "audit")


async def by_use(db: asyncpg.Connection) -> Counter[str]:
    """The test database's client connections but ``db``'s, by application_name."""
    rows = await db.fetch(
        "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
    )
    return Counter(r[0] for r in rows)


async def none_left(db: asyncpg.Connection) -> None:
    """Every connection but ``db``'s has ended (a backend ends a moment after its client)."""
    await wait_until(lambda: by_use(db), until=lambda seen: not seen, timeout=10)


def endpoint(dsn: str, name: str, handled: list[tuple[str, int]], **overrides: object) -> Bus:
    """A Bus that records what it handles; it is woken by NOTIFY alone (the poll is 300 s)."""
    settings: dict[str, object] = {"poll_interval": 300.0, "concurrency": 1, "send_pool_size": 1}
    settings.update(overrides)
    bus = Bus(name, dsn=dsn, **settings)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        handled.append((name, msg.n))

    return bus


async def each_wakes_on_its_own_notify(
    buses: list[Bus], sender: Bus, handled: list[tuple[str, int]], n: int
) -> None:
    """Message ``n`` to each of ``buses``, every loop idle first: only NOTIFY can wake them.

    An idle loop waits for a wake-up or its 300 s poll; a loop still busy could
    claim the message on its way, which is why each round waits for idleness.
    """
    for bus in buses:
        await wait_until(lambda bus=bus: bus.worker._wakeups.idle == bus.settings.concurrency)
    for bus in buses:
        await sender.send(Ping(n=n), to=bus.endpoint)
    expected = {(bus.endpoint, n) for bus in buses}
    await wait_until(lambda: expected <= set(handled), timeout=20, what=f"round {n} handled")


async def test_an_endpoint_names_each_connection_and_uses_at_most_its_budget(
    dsn: str, db: asyncpg.Connection
) -> None:
    # send_pool_size + concurrency + 1 LISTEN + 1 for the leases, each named for its use.
    bus = Bus("billing", dsn=dsn, concurrency=2, send_pool_size=3, lease_seconds=1.5)
    running, release = asyncio.Event(), asyncio.Event()

    @bus.handler
    async def hold(msg: Ping, ctx: Context) -> None:
        running.set()
        await release.wait()

    async with bus:
        await bus.send(Ping(n=1), to="billing")
        await asyncio.wait_for(running.wait(), 10)
        async with AsyncExitStack() as stack:
            pool = bus.store.pool  # type: ignore[attr-defined]
            for _ in range(3):  # the application holds every pooled connection
                await stack.enter_async_context(pool.acquire())
            # The renewer (every lease_seconds / 3) opens the leases' connection.
            seen = await wait_until(
                lambda: by_use(db), until=lambda seen: seen["nmbus:billing:lease"] == 1
            )
            assert seen == {
                "nmbus:send": 3,
                "nmbus:billing:loop": 2,
                "nmbus:listen": 1,
                "nmbus:billing:lease": 1,
            }
        release.set()
    await none_left(db)


async def test_a_dsn_that_names_its_connections_keeps_its_name(
    dsn: str, db: asyncpg.Connection
) -> None:
    named = dsn + ("&" if "?" in dsn else "?") + "application_name=billing-app"
    handled: list[tuple[str, int]] = []
    bus = endpoint(named, "billing", handled, lease_seconds=1.5)
    async with bus:
        await each_wakes_on_its_own_notify([bus], bus, handled, 1)
        seen = await wait_until(lambda: by_use(db), until=lambda seen: seen["billing-app"] >= 3)
        assert set(seen) == {"billing-app"}  # loop, listen and the pool, all under its name
    await none_left(db)


async def test_endpoints_of_one_process_share_one_pool_and_one_listener(
    dsn: str, db: asyncpg.Connection
) -> None:
    handled: list[tuple[str, int]] = []
    buses = [endpoint(dsn, name, handled) for name in ENDPOINTS]
    sender = buses[-1]
    async with AsyncExitStack() as stack:
        for bus in buses:
            await stack.enter_async_context(bus)
        pools = {id(bus.store.pool) for bus in buses}  # type: ignore[attr-defined]
        assert len(pools) == 1
        for n in (1, 2, 3):  # the first round may also be woken by the listener's connect
            await each_wakes_on_its_own_notify(buses, sender, handled, n)
        seen = await by_use(db)
        assert seen["nmbus:send"] == 1  # three pools would hold at least one each
        assert seen["nmbus:listen"] == 1
        assert {name: seen[f"nmbus:{name}:loop"] for name in ENDPOINTS} == dict.fromkeys(
            ENDPOINTS, 1
        )

        # The first to start (which opened the pool and the listener) stops first.
        await buses[0].stop()
        await each_wakes_on_its_own_notify(buses[1:], sender, handled, 4)
        seen = await by_use(db)
        assert (seen["nmbus:send"], seen["nmbus:listen"], seen["nmbus:billing:loop"]) == (1, 1, 0)
    await none_left(db)


async def test_endpoints_started_and_stopped_at_once_share_what_the_first_opened(
    dsn: str, db: asyncpg.Connection
) -> None:
    handled: list[tuple[str, int]] = []
    buses = [endpoint(dsn, name, handled) for name in ENDPOINTS]
    await asyncio.gather(*(bus.start() for bus in buses))
    try:
        assert len({id(bus.store.pool) for bus in buses}) == 1  # type: ignore[attr-defined]
        for n in (1, 2):
            await each_wakes_on_its_own_notify(buses, buses[0], handled, n)
        seen = await by_use(db)
        assert (seen["nmbus:send"], seen["nmbus:listen"]) == (1, 1)
    finally:
        await asyncio.gather(*(bus.stop() for bus in buses))
    await none_left(db)
    # And the next ones start afresh.
    again = endpoint(dsn, "billing", handled)
    async with again:
        await each_wakes_on_its_own_notify([again], again, handled, 3)
    await none_left(db)


async def test_the_shared_listener_reconnects_for_every_endpoint(
    dsn: str, db: asyncpg.Connection
) -> None:
    handled: list[tuple[str, int]] = []
    buses = [endpoint(dsn, name, handled, reconnect_max_delay=0.5) for name in ENDPOINTS]
    async with AsyncExitStack() as stack:
        for bus in buses:
            await stack.enter_async_context(bus)
        await each_wakes_on_its_own_notify(buses, buses[0], handled, 1)
        listening = (
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = 'nmbus:listen'"
        )
        (old,) = [r[0] for r in await db.fetch(listening)]
        assert await db.fetchval("SELECT pg_terminate_backend($1)", old)
        await wait_until(
            lambda: db.fetch(listening),
            until=lambda rows: [r[0] for r in rows] not in ([], [old]),
            what="the listener connected again",
        )
        # Round 2 may be woken by the reconnection's look at everything; round 3 by NOTIFY only.
        for n in (2, 3):
            await each_wakes_on_its_own_notify(buses, buses[0], handled, n)
    await none_left(db)


async def test_an_endpoint_that_fails_to_start_lets_go_of_the_shared_pool(
    dsn: str, db: asyncpg.Connection
) -> None:
    handled: list[tuple[str, int]] = []
    running = endpoint(dsn, "billing", handled)
    # Its route reaches its own database: refused once its store is open.
    spelt_otherwise = dsn + ("&" if "?" in dsn else "?") + "application_name=elsewhere"
    refused = endpoint(dsn, "shipping", handled, routes={"audit": spelt_otherwise})
    async with running:
        with pytest.raises(ConfigurationError):
            await refused.start()
        await each_wakes_on_its_own_notify([running], running, handled, 1)
    await none_left(db)


@pytest.mark.parametrize("stop_first", [False, True])
def test_endpoints_in_a_new_event_loop_never_get_the_last_ones_connections(
    dsn: str, stop_first: bool
) -> None:
    """asyncpg connections belong to their loop: each loop has its own shared ones."""
    handled: list[tuple[str, int]] = []

    async def first() -> None:
        bus = endpoint(dsn, "billing", handled)
        await bus.start()
        await each_wakes_on_its_own_notify([bus], bus, handled, 1)
        if stop_first:
            await bus.stop()
        # Else the loop ends with the bus running: its tasks are cancelled, its pool never closed.

    async def second() -> None:
        bus = endpoint(dsn, "billing", handled)
        async with bus:
            await each_wakes_on_its_own_notify([bus], bus, handled, 2)
        db = await asyncpg.connect(dsn)
        try:
            # What the first loop left open, if anything, goes with the test database.
            await db.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        finally:
            await db.close()

    asyncio.run(first())
    asyncio.run(second())
    assert handled == [("billing", 1), ("billing", 2)]
