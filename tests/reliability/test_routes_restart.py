"""A remote database on a second PostgreSQL server, stopped and restarted mid-run.

The server is this test's own (initdb'd from the machine's binaries on a free
port), never the shared one. While it is down the outbox backlog grows and
nothing is lost; once it is back the bus's own forwarder delivers everything,
by itself, exactly once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import asyncpg
import pytest

from nmbus import Bus, Message
from nmbus.ops.admin import Admin
from tests.pg import with_database
from tests.reliability.pgserver import PrivateServer, private_server
from tests.waits import wait_until


class Shipped(Message, type_name="test.routes.Shipped"):
    n: int


@pytest.fixture
def remote_server() -> Iterator[PrivateServer]:
    """A server of this test's own: it stops and starts it."""
    with private_server() as server:
        yield server


async def _database(server: PrivateServer, name: str) -> str:
    """A new database on ``server``; its DSN."""
    conn = await asyncpg.connect(server.dsn)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return with_database(server.dsn, name)


async def test_the_remote_server_stopped_and_restarted_mid_run(
    dsn: str, db: asyncpg.Connection, remote_server: PrivateServer
) -> None:
    remote = await _database(remote_server, "shipping")
    bus = Bus(
        "orders",
        dsn=dsn,
        routes={"shipping": remote},
        poll_interval=1.0,
        reconnect_max_delay=0.5,
    )
    bus.handler(Shipped)(_nothing)
    sent: list[str] = []

    async def remote_count() -> int:
        conn = await asyncpg.connect(remote)
        try:
            if not await conn.fetchval("SELECT to_regclass('nmbus.shipping')"):
                return 0
            return int(await conn.fetchval("SELECT count(DISTINCT unique_id) FROM nmbus.shipping"))
        finally:
            await conn.close()

    async def outbox() -> int:
        return int(await db.fetchval("SELECT count(*) FROM nmbus.outbox"))

    async def send(count: int) -> None:
        for _ in range(count):
            sent.append(await bus.send(Shipped(n=len(sent)), to="shipping"))

    async with bus:
        await send(100)
        await wait_until(remote_count, until=lambda n: n == 100, timeout=60)
        sending = asyncio.create_task(send(400))  # the stop lands mid-run
        await wait_until(lambda: len(sent) > 100, interval=0.005, what="the second run begun")
        remote_server.stop()
        await sending
        await send(100)
        # The remote is down: whatever was not forwarded before the stop waits.
        waiting = await outbox()
        assert waiting >= 100
        async with Admin(dsn) as admin:
            [route] = await admin.route_status({"shipping": remote}, timeout=2.0)
        assert route.reachable is False and route.waiting == waiting
        remote_server.start()
        # Nothing is done by hand: the bus's forwarder resumes on its own.
        await wait_until(remote_count, until=lambda n: n == 600, timeout=60)
        await wait_until(outbox, until=lambda n: n == 0, timeout=60)
    conn = await asyncpg.connect(remote)
    try:
        rows = await conn.fetch("SELECT unique_id FROM nmbus.shipping")
    finally:
        await conn.close()
    assert len(rows) == 600
    assert {r[0] for r in rows} == set(sent)


class Returned(Message, type_name="test.routes.Returned"):
    n: int


async def test_a_subscriber_starts_while_its_publishers_database_is_down(
    dsn: str, remote_server: PrivateServer
) -> None:
    publisher_dsn = await _database(remote_server, "orders")
    remote_server.stop()

    got: list[int] = []
    billing = Bus(
        "billing",
        dsn=dsn,
        routes={"orders": publisher_dsn},
        poll_interval=1.0,
        reconnect_max_delay=0.5,
        subscription_ttl=3600,
    )

    @billing.handler
    async def on_shipped(msg: Shipped, ctx: object) -> None:
        got.append(msg.n)

    billing.handler(Returned)(_nothing)
    billing.subscribe(Shipped, publisher="orders")
    billing.subscribe(Returned, publisher="orders", permanent=True)

    async def rows() -> list[tuple[str, bool]]:
        try:
            conn = await asyncpg.connect(publisher_dsn)
        except OSError:
            return []
        try:
            if not await conn.fetchval("SELECT to_regclass('nmbus.subscriptions')"):
                return []
            found = await conn.fetch(
                "SELECT message_type, expiration_date IS NULL FROM nmbus.subscriptions "
                "WHERE subscriber_endpoint = 'billing' AND subscriber_remote ORDER BY 1"
            )
            return [(r[0], r[1]) for r in found]
        finally:
            await conn.close()

    async with billing:  # the publisher's database is down: it starts all the same
        assert billing.subscriptions.pending == {"orders"}
        await billing.send(Shipped(n=1), to="billing")  # its own queue works meanwhile
        await wait_until(lambda: 1 in got, timeout=60, what="message 1 handled")
        remote_server.start()
        # Nothing is done by hand: both rows, the permanent one too, get written.
        want = [("test.routes.Returned", True), ("test.routes.Shipped", False)]
        await wait_until(rows, until=lambda found: found == want, timeout=60)
        assert billing.subscriptions.pending == set()
        orders = Bus("orders", dsn=publisher_dsn, routes={"billing": dsn}, poll_interval=1.0)
        orders.handler(Returned)(_nothing)
        async with orders:
            assert await orders.publish(Shipped(n=2)) == ["billing"]
            await wait_until(lambda: 2 in got, timeout=60, what="message 2 handled")
    assert got == [1, 2]


async def _nothing(msg: Shipped, ctx: object) -> None:
    pass
