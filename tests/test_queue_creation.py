"""A send to a queue no endpoint created (issue 23, defect 10: typos create tables).

By default such a send still creates the table (tests, samples and deployments
send before the receiving endpoint first starts), but it is logged once as
``queue_created_by_send`` and the table is marked until an endpoint starts on
it; ``create_queues=False`` refuses it with QueueNotFound.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest
import structlog
from structlog.testing import capture_logs
from typer.testing import CliRunner, Result

from nmbus import Bus, Context, QueueNotFound
from nmbus.cli import app
from nmbus.ops.admin import DEPTH_CHUNK, Admin
from nmbus.postgres.sql import render
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


# -- shown as such: `nmbus status` and the operations layer ------------------------------------

NOTE = "created by a send from orders, no endpoint has started on it"


def status(dsn: str, *args: str) -> Result:
    saved = structlog.get_config()  # the CLI configures logging for the process
    try:
        result = CliRunner().invoke(
            app, ["status", "--dsn", dsn, *args], env={"COLUMNS": "200", "NMBUS_DSN": None}
        )
    finally:
        structlog.configure(**saved)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return result


async def test_status_shows_a_queue_a_send_created_until_its_endpoint_starts(
    make_bus: Callable[..., Bus], dsn: str
) -> None:
    async with make_bus("orders", concurrency=0) as sender:
        await sender.send(Ping(n=1), to="bililng")  # a typo
    got = json.loads((await asyncio.to_thread(status, dsn, "--json")).stdout)
    fields = ("created_by_send", "first_sender", "note")
    marks = {q["queue"]: tuple(q[f] for f in fields) for q in got["queues"]}
    assert marks == {"bililng": (True, "orders", NOTE), "orders": (False, None, None)}
    text = (await asyncio.to_thread(status, dsn)).stdout
    assert "created by a send" in text and NOTE in " ".join(text.split()), text
    async with Admin(dsn) as admin:
        assert await admin.queues_created_by_send() == {"bililng": "orders"}
        depths = {d.queue: d.created_by_send for d in await admin.queue_depths()}
        assert depths == {"bililng": True, "orders": False}
        assert (await admin.queue_detail("bililng")).created_by_send_note == NOTE
    # Its endpoint starts: the queue is one someone meant, and no longer shown as a typo.
    async with make_bus("bililng", concurrency=0):
        pass
    got = json.loads((await asyncio.to_thread(status, dsn, "--json")).stdout)
    assert [q["created_by_send"] for q in got["queues"]] == [False, False]
    assert [q["note"] for q in got["queues"]] == [None, None]
    assert "created by a send" not in (await asyncio.to_thread(status, dsn)).stdout
    async with Admin(dsn) as admin:
        assert await admin.queues_created_by_send() == {}
        assert not any(d.created_by_send for d in await admin.queue_depths())


async def test_the_marks_of_many_queues_are_read_in_a_few_statements(
    make_bus: Callable[..., Bus], dsn: str, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page over hundreds of queues reads the marks once, not once per queue."""
    async with make_bus("orders", concurrency=0):
        pass
    names = [f"typo{n:03}" for n in range(3 * DEPTH_CHUNK)]
    for name in names:  # as a send leaves them (docs/operations.md), made faster in SQL
        await db.execute(render("create_queue", "nmbus", name))
        await db.execute(render("register_queue", "nmbus"), name)
        await db.execute(render("mark_created_by_send", "nmbus", name))
    await db.execute(
        "INSERT INTO nmbus.typo007 (from_endpoint, to_endpoint, label, msg_text) "
        "VALUES ('shop', 'typo007', 'x', '{}'), ('orders', 'typo007', 'x', '{}')"
    )
    statements: list[str] = []
    create_pool = asyncpg.create_pool

    def counting_pool(*args: Any, **kwargs: Any) -> Any:
        given = kwargs.pop("init", None)  # the operations' own session settings

        async def init(conn: asyncpg.Connection) -> None:
            if given is not None:
                await given(conn)
            conn.add_query_logger(lambda record: statements.append(record.query))

        return create_pool(*args, init=init, **kwargs)

    monkeypatch.setattr(asyncpg, "create_pool", counting_pool)
    async with Admin(dsn) as admin:
        await admin.schema_exists()
        statements.clear()
        found = await admin.queue_status()
    assert {q.queue for q in found if q.created_by_send} == set(names)
    assert {q.queue: q.first_sender for q in found if q.first_sender} == {"typo007": "shop"}
    assert sum("obj_description" in s for s in statements) == 1
    assert sum("from_endpoint AS sender" in s for s in statements) == 1
