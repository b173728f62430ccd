"""A send to a queue no endpoint created (issue 23, defect 10: typos create tables).

By default such a send still creates the table (tests, samples and deployments
send before the receiving endpoint first starts), but it is logged once as
``queue_created_by_send`` and the table is marked until an endpoint starts on
it; ``create_queues=False`` refuses it with QueueNotFound.
"""

from __future__ import annotations

from collections.abc import Callable

import asyncpg
import pytest
from structlog.testing import capture_logs

from nmbus import Bus, Context, QueueNotFound
from nmbus.testing import drain
from tests.messages import Ping, Pong

CREATED_BY_SEND = "nmbus: created by a send; no endpoint has started on it"  # docs/operations.md


async def comment(db: asyncpg.Connection, queue: str) -> str | None:
    return await db.fetchval(
        "SELECT obj_description(to_regclass(format('nmbus.%I', $1::text)), 'pg_class')", queue
    )


async def exists(db: asyncpg.Connection, queue: str) -> bool:
    return bool(await db.fetchval("SELECT to_regclass(format('nmbus.%I', $1::text))", queue))


async def test_a_send_that_creates_a_queue_is_logged_once_and_marked(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    with capture_logs() as logs:
        async with make_bus("orders", concurrency=0) as sender:
            for n in range(3):
                await sender.send(Ping(n=n), to="bililng")  # a typo
            conn = await asyncpg.connect(sender.settings.dsn)
            try:
                async with conn.transaction():
                    await sender.send(Ping(n=9), to="shiping", connection=conn)
            finally:
                await conn.close()
    created = [e for e in logs if e["event"] == "queue_created_by_send"]
    assert [(e["queue"], e["sender"]) for e in created] == [
        ("bililng", "orders"),
        ("shiping", "orders"),
    ]
    assert await comment(db, "bililng") == CREATED_BY_SEND
    assert await comment(db, "shiping") == CREATED_BY_SEND
    assert await comment(db, "orders") is None  # its endpoint started: never marked
    # Its endpoint starts: the queue is one someone meant, the mark goes.
    async with make_bus("bililng", concurrency=0):
        pass
    assert await comment(db, "bililng") is None


async def test_a_handler_reply_to_a_missing_queue_is_marked_too(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    """A reply-to header naming a queue of another database made the replier create it."""
    bus = make_bus("billing", poll_interval=0.2)

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        await ctx.reply(Pong(n=msg.n))

    async with bus:
        await bus.send(Ping(n=1), to="billing", reply_to="elsewhere")
        with capture_logs() as logs:
            await drain(bus)
    assert [e["queue"] for e in logs if e["event"] == "queue_created_by_send"] == ["elsewhere"]
    assert await comment(db, "elsewhere") == CREATED_BY_SEND
    assert await db.fetchval("SELECT subqueue FROM nmbus.billing") == "X"


async def test_with_create_queues_off_a_send_to_a_missing_queue_is_refused(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    async with make_bus("orders", concurrency=0, create_queues=False) as sender:
        for _ in range(300):  # 300 mistyped sends made 300 tables
            with pytest.raises(QueueNotFound, match=r"no queue 'bililng'.*typo"):
                await sender.send(Ping(n=1), to="bililng")
        conn = await asyncpg.connect(sender.settings.dsn)
        try:
            with pytest.raises(QueueNotFound, match="no queue 'shiping'"):
                async with conn.transaction():
                    await sender.send(Ping(n=2), to="shiping", connection=conn)
        finally:
            await conn.close()
        assert not await exists(db, "bililng") and not await exists(db, "shiping")
        # Once its endpoint has started, the same send goes through (the cache of
        # known queues is refreshed on a miss).
        async with make_bus("bililng", concurrency=0):
            pass
        await sender.send(Ping(n=3), to="bililng")
    assert await db.fetchval("SELECT count(*) FROM nmbus.bililng") == 1


def test_create_queues_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from nmbus import Settings

    monkeypatch.setenv("NMBUS_CREATE_QUEUES", "false")
    assert Settings().create_queues is False
