"""A remote database on a second PostgreSQL server, stopped and restarted mid-run.

The server is this test's own (initdb'd from the machine's binaries on a free
port), never the shared one. While it is down the outbox backlog grows and
nothing is lost; once it is back the bus's own forwarder delivers everything,
by itself, exactly once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import asyncpg
import pytest

from nmbus import Bus, Message
from nmbus.admin import Admin
from tests.pg import with_database
from tests.reliability.pgserver import PrivateServer


class Shipped(Message, type_name="test.routes.Shipped"):
    n: int


@pytest.fixture
def remote_server() -> Iterator[PrivateServer]:
    server = PrivateServer()
    try:
        server.init()
        server.start()
        yield server
    finally:
        server.remove()


async def wait_until(check: Callable[[], Any], timeout: float = 60.0) -> None:
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.05)


async def test_the_remote_server_stopped_and_restarted_mid_run(
    dsn: str, db: asyncpg.Connection, remote_server: PrivateServer
) -> None:
    admin_conn = await asyncpg.connect(remote_server.dsn)
    try:
        await admin_conn.execute("CREATE DATABASE shipping")
    finally:
        await admin_conn.close()
    remote = with_database(remote_server.dsn, "shipping")
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
        await wait_until(lambda: _equals(remote_count, 100))
        sending = asyncio.create_task(send(400))  # the stop lands mid-run
        await asyncio.sleep(0.05)
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
        await wait_until(lambda: _equals(remote_count, 600))
        await wait_until(lambda: _equals(outbox, 0))
    conn = await asyncpg.connect(remote)
    try:
        rows = await conn.fetch("SELECT unique_id FROM nmbus.shipping")
    finally:
        await conn.close()
    assert len(rows) == 600
    assert {r[0] for r in rows} == set(sent)


async def _nothing(msg: Shipped, ctx: object) -> None:
    pass


async def _equals(read: Callable[[], Any], want: int) -> bool:
    return bool(await read() == want)
