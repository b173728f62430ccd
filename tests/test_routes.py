"""Endpoints in several databases: routes, the outbox and the forwarder (docs/routes.md).

Two databases of the test server: A (the sender's, ``dsn``) and B (the
remote, ``dsn_b``, made by the test from the same server).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import structlog
from typer.testing import CliRunner

from nmbus import Bus, Context, Message
from nmbus.cli import app
from nmbus.errors import ConfigurationError, InvalidSetting
from nmbus.ops.admin import Admin
from nmbus.ports.store import SCHEMA_VERSION
from nmbus.postgres import install_schema
from nmbus.postgres.forwarder import Forwarder, RemoteUnavailable
from nmbus.settings import Settings, build_settings
from tests.pg import Databases
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parent.parent


class OrderPlaced(Message, type_name="test.routes.OrderPlaced"):
    order_id: int


class Invoiced(Message, type_name="test.routes.Invoiced"):
    order_id: int


@pytest.fixture
def dsn_b(databases: Databases) -> Iterator[str]:
    """A second fresh database on the same server: the remote one."""
    with databases.fresh() as fresh:
        yield fresh


@pytest.fixture
async def db_b(dsn_b: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(dsn_b)
    try:
        yield conn
    finally:
        await conn.close()


async def remote_ids(db: asyncpg.Connection, queue: str = "billing") -> list[str]:
    if not await db.fetchval("SELECT to_regclass(format('nmbus.%I', $1::text))", queue):
        return []
    rows = await db.fetch(f'SELECT unique_id FROM nmbus."{queue}" ORDER BY id')
    return [r[0] for r in rows]


async def outbox(db: asyncpg.Connection) -> list[asyncpg.Record]:
    return await db.fetch("SELECT * FROM nmbus.outbox ORDER BY id")


def fast(**extra: Any) -> dict[str, Any]:
    return {"poll_interval": 2.0, "lease_seconds": 10.0, "reconnect_max_delay": 0.5, **extra}


# -- settings ---------------------------------------------------------------------------


def test_routes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NMBUS_ROUTES", "billing=b, shipping=B,audit=c")
    monkeypatch.setenv("NMBUS_DB_B", "postgresql://u:s3cret@hb/db")
    monkeypatch.setenv("NMBUS_DB_C", "postgresql://u@hc/db")
    settings = Settings()
    assert settings.route_dsns() == {
        "billing": "postgresql://u:s3cret@hb/db",
        "shipping": "postgresql://u:s3cret@hb/db",
        "audit": "postgresql://u@hc/db",
    }
    assert "s3cret" not in repr(settings)


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"routes": "billing=nowhere"}, "NMBUS_DB_NOWHERE"),
        ({"routes": "billing"}, "queue=alias"),
        ({"routes": {"no way": "postgresql://x@h/d"}}, "invalid queue name"),
        ({"routes": {"billing": "b"}, "databases": {"b": "mysql://u:s3cret@h/d"}}, "postgresql"),
        ({"databases": {"9x": "postgresql://u:s3cret@h/d"}}, "alias"),
    ],
)
def test_bad_routes_are_refused_without_passwords(values: dict[str, Any], says: str) -> None:
    with pytest.raises(InvalidSetting) as caught:
        build_settings(**values)
    assert says in str(caught.value)
    assert "s3cret" not in str(caught.value)


def test_an_endpoint_cannot_route_itself_away() -> None:
    with pytest.raises(ConfigurationError, match="own database"):
        Bus("billing", dsn="postgresql://u@h/a", routes={"billing": "postgresql://u@h/b"})


@pytest.mark.parametrize(
    "spell",
    [
        lambda dsn: dsn,
        lambda dsn: dsn.replace("postgresql://", "postgres://", 1),
        lambda dsn: dsn + ("&" if "?" in dsn else "?") + "application_name=elsewhere",
    ],
    ids=["same-text", "other-scheme", "other-options"],
)
async def test_a_route_to_the_endpoints_own_database_is_refused_at_start(
    dsn: str, db: asyncpg.Connection, spell: Callable[[str], str]
) -> None:
    """Issue 23 defect 7: a subscriber whose route names its own database wrote its
    subscription as remote, and the publisher's copies waited in the outbox for ever."""
    with pytest.raises(ConfigurationError, match="own database"):
        billing = Bus("billing", dsn=dsn, routes={"orders": spell(dsn)}, **fast())
        billing.subscribe(OrderPlaced, publisher="orders")
        async with billing:
            pass
    assert await db.fetchval("SELECT count(*) FROM nmbus.subscriptions") == 0
    assert await db.fetchval("SELECT to_regclass('nmbus.billing')") is None


async def test_a_route_to_another_database_of_the_same_server_still_starts(
    dsn: str, dsn_b: str, db_b: asyncpg.Connection
) -> None:
    orders = Bus("orders", dsn=dsn, routes={"billing": dsn_b}, concurrency=0)
    async with orders:
        await orders.send(OrderPlaced(order_id=1), to="billing")
    async with Bus("nobody", dsn=dsn, routes={"billing": "postgresql://x@127.0.0.1:1/no"}):
        pass  # a route to a database that is down does not stop a start either


def test_routes_need_the_postgres_store() -> None:
    from nmbus.testing import MemoryStore

    with pytest.raises(ConfigurationError, match="PostgreSQL store"):
        Bus("orders", store=MemoryStore(), routes={"billing": "postgresql://u@h/b"})


# -- send -------------------------------------------------------------------------------


async def test_a_routed_send_is_handled_in_the_other_database(
    dsn: str, dsn_b: str, db: asyncpg.Connection, db_b: asyncpg.Connection
) -> None:
    got: list[tuple[int, str]] = []
    # No poll in this test's lifetime: only NOTIFY can wake the forwarder and the worker.
    quiet = fast(poll_interval=3600.0)
    billing = Bus("billing", dsn=dsn_b, **quiet)

    @billing.handler
    async def charge(msg: OrderPlaced, ctx: Context) -> None:
        got.append((msg.order_id, ctx.from_endpoint))

    orders = Bus("orders", dsn=dsn, routes={"billing": dsn_b}, **quiet)
    orders.handler(OrderPlaced)(_ignore)
    async with billing, orders:
        await asyncio.sleep(0.3)  # the listeners connect (and look at what waits) first
        uid = await orders.send(OrderPlaced(order_id=1), to="billing")
        await wait_until(lambda: got, what="the remote handler run")
        await _outbox_empty(db)
    assert got == [(1, "orders")]
    assert await remote_ids(db_b) == [uid]
    # Nothing of billing's was ever made in the sender's database.
    assert await db.fetchval("SELECT to_regclass('nmbus.billing')") is None


async def _ignore(msg: OrderPlaced, ctx: Context) -> None:
    pass


async def _outbox_empty(db: asyncpg.Connection) -> None:
    await wait_until("SELECT count(*) FROM nmbus.outbox", db=db, until=lambda n: n == 0)


async def test_a_rolled_back_send_never_reaches_the_remote(
    dsn: str, dsn_b: str, db: asyncpg.Connection, db_b: asyncpg.Connection
) -> None:
    orders = Bus("orders", dsn=dsn, routes={"billing": dsn_b}, concurrency=0)
    async with orders:
        conn = await asyncpg.connect(dsn)
        try:
            tx = conn.transaction()
            await tx.start()
            lost = await orders.send(OrderPlaced(order_id=1), to="billing", connection=conn)
            assert len(await db.fetch("SELECT 1 FROM nmbus.outbox")) == 0  # not committed
            await tx.rollback()
            async with conn.transaction():
                kept = await orders.send(OrderPlaced(order_id=2), to="billing", connection=conn)
        finally:
            await conn.close()
    forwarder = Forwarder(dsn, {"billing": dsn_b}, batch_size=10)
    try:
        assert await forwarder.forward_all() == 1
    finally:
        await forwarder.close()
    assert await remote_ids(db_b) == [kept]
    assert lost not in await remote_ids(db_b)
    assert await outbox(db) == []


async def test_a_resent_unique_id_is_stored_once_remotely(
    dsn: str, dsn_b: str, db_b: asyncpg.Connection
) -> None:
    orders = Bus("orders", dsn=dsn, routes={"billing": dsn_b}, concurrency=0)
    forwarder = Forwarder(dsn, {"billing": dsn_b})
    try:
        async with orders:
            await orders.send(OrderPlaced(order_id=1), to="billing", unique_id="u-1")
            await orders.send(OrderPlaced(order_id=1), to="billing", unique_id="u-1")
            assert await forwarder.forward_all() == 1  # the outbox held it once
            await orders.send(OrderPlaced(order_id=1), to="billing", unique_id="u-1")
            assert await forwarder.forward_all() == 1  # the remote refused the copy
    finally:
        await forwarder.close()
    assert await remote_ids(db_b) == ["u-1"]
    assert (forwarder.stats.taken, forwarder.stats.inserted) == (2, 1)


class DiesAfterRemoteCommit(Forwarder):
    """Fails in the window between the remote commit and the local delete."""

    async def _deliver(self, remote: Any, queue: str, rows: Sequence[Any]) -> int:
        # Returns once the remote committed, before the outbox rows are deleted.
        await super()._deliver(remote, queue, rows)
        raise RuntimeError("died after the remote commit")


async def test_a_failure_after_the_remote_commit_duplicates_nothing(
    dsn: str, dsn_b: str, db: asyncpg.Connection, db_b: asyncpg.Connection
) -> None:
    orders = Bus("orders", dsn=dsn, routes={"billing": dsn_b}, concurrency=0)
    async with orders:
        sent = [await orders.send(OrderPlaced(order_id=i), to="billing") for i in range(7)]
    dying = DiesAfterRemoteCommit(dsn, {"billing": dsn_b}, batch_size=5)
    with pytest.raises(RuntimeError, match="after the remote commit"):
        await dying.forward_all()
    await dying.close()
    assert await remote_ids(db_b) == sent[:5]  # committed remotely...
    assert len(await outbox(db)) == 7  # ...and still in the outbox
    forwarder = Forwarder(dsn, {"billing": dsn_b}, batch_size=5)
    try:
        assert await forwarder.forward_all() == 7
    finally:
        await forwarder.close()
    assert await remote_ids(db_b) == sent
    assert (forwarder.stats.taken, forwarder.stats.inserted) == (7, 2)
    assert await outbox(db) == []


async def test_two_forwarders_at_once_move_each_row_once_and_in_order(
    dsn: str, dsn_b: str, db_b: asyncpg.Connection
) -> None:
    orders = Bus("orders", dsn=dsn, routes={"billing": dsn_b}, concurrency=0)
    async with orders:
        conn = await asyncpg.connect(dsn)
        try:
            async with conn.transaction():
                sent = [
                    await orders.send(OrderPlaced(order_id=i), to="billing", connection=conn)
                    for i in range(300)
                ]
        finally:
            await conn.close()
    pair = [Forwarder(dsn, {"billing": dsn_b}, batch_size=20) for _ in range(2)]
    try:
        await asyncio.gather(*(f.forward_all() for f in pair))
    finally:
        for forwarder in pair:
            await forwarder.close()
    # The per-queue lock: no row was taken twice, and the remote ids keep the send order.
    assert sum(f.stats.taken for f in pair) == 300
    assert sum(f.stats.inserted for f in pair) == 300
    assert await remote_ids(db_b) == sent


async def test_a_handler_sends_and_publishes_to_other_databases_in_its_transaction(
    dsn: str, dsn_b: str, db: asyncpg.Connection, db_b: asyncpg.Connection
) -> None:
    billing = Bus("billing", dsn=dsn_b, routes={"orders": dsn}, concurrency=0)
    billing.subscribe(Invoiced, publisher="orders")
    async with billing:
        pass  # its subscription is in the orders database now
    orders = Bus("orders", dsn=dsn, routes={"billing": dsn_b}, **fast(max_attempts=1))

    @orders.handler
    async def place(msg: OrderPlaced, ctx: Context) -> None:
        await ctx.send(OrderPlaced(order_id=msg.order_id * 10), to="billing")
        await ctx.publish(Invoiced(order_id=msg.order_id))
        if msg.order_id == 2:
            raise RuntimeError("this handler's sends roll back with it")

    async with orders:
        await orders.send(OrderPlaced(order_id=1), to="orders")
        await orders.send(OrderPlaced(order_id=2), to="orders")
        done = "SELECT count(*) FROM nmbus.orders WHERE subqueue IN ('X', 'F')"
        await wait_until(done, db=db, until=lambda n: n == 2)
        await _outbox_empty(db)
    rows = await db_b.fetch("SELECT label, msg_text, from_endpoint FROM nmbus.billing ORDER BY id")
    assert [(r[0], json.loads(r[1])["order_id"], r[2]) for r in rows] == [
        ("test.routes.OrderPlaced", 10, "orders"),
        ("test.routes.Invoiced", 1, "orders"),
    ]


async def test_a_queue_another_forwarder_holds_does_not_hold_back_the_others(
    dsn: str, dsn_b: str, db_b: asyncpg.Connection
) -> None:
    routes = {"billing": dsn_b, "shipping": dsn_b}  # two queues of one remote database
    sender = Bus("orders", dsn=dsn, routes=routes, concurrency=0)
    holder = await asyncpg.connect(dsn)
    forwarder = Forwarder(dsn, routes)
    try:
        async with sender:
            await sender.send(OrderPlaced(order_id=1), to="billing", unique_id="b-1")
            await sender.send(OrderPlaced(order_id=2), to="shipping", unique_id="s-2")
        held = holder.transaction()
        await held.start()  # another forwarder is moving billing's rows
        assert await holder.fetchval("SELECT pg_try_advisory_xact_lock(hashtext($1))",
                                     "nmbus.outbox.nmbus.billing")  # fmt: skip
        await forwarder.forward_pending()
        assert await remote_ids(db_b, "billing") == []
        assert await remote_ids(db_b, "shipping") == ["s-2"]
        # billing waits for its lock; shipping's next row does not wait with it.
        async with Bus("orders", dsn=dsn, routes=routes, concurrency=0) as again:
            await again.send(OrderPlaced(order_id=3), to="shipping", unique_id="s-3")
        forwarder.wake("shipping")
        await forwarder.forward_pending()
        assert await remote_ids(db_b, "shipping") == ["s-2", "s-3"]
        await held.rollback()
        await asyncio.sleep(0.25)  # billing's pause
        await forwarder.forward_pending()
        assert await remote_ids(db_b, "billing") == ["b-1"]
    finally:
        await forwarder.close()
        await holder.close()


async def test_a_remote_that_is_unreachable_keeps_the_rows(
    dsn: str, db: asyncpg.Connection
) -> None:
    nowhere = "postgresql://postgres@127.0.0.1:1/nothing"
    orders = Bus("orders", dsn=dsn, routes={"billing": nowhere}, concurrency=0)
    async with orders:
        await orders.send(OrderPlaced(order_id=1), to="billing")
    forwarder = Forwarder(dsn, {"billing": nowhere})
    try:
        with pytest.raises(RemoteUnavailable):
            await forwarder.forward_all()
    finally:
        await forwarder.close()
    assert len(await outbox(db)) == 1
    async with Admin(dsn) as admin:
        [route] = await admin.route_status({"billing": nowhere})
    assert route.reachable is False
    assert route.queues[0].queue == "billing" and route.queues[0].waiting == 1


async def test_a_remote_that_hangs_is_never_waited_for_inside_a_local_transaction(
    dsn: str, db: asyncpg.Connection
) -> None:
    # A server that accepts the connection and never answers: connecting waits
    # for its whole timeout. Meanwhile the outbox's database must see no open
    # transaction of the forwarder (it would hold back vacuum for the outage).
    accepted = asyncio.Event()
    held: list[asyncio.StreamWriter] = []

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        accepted.set()

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    hanging = f"postgresql://postgres@127.0.0.1:{port}/nothing"
    orders = Bus("orders", dsn=dsn, routes={"billing": hanging}, concurrency=0)
    async with orders:
        await orders.send(OrderPlaced(order_id=1), to="billing")
    forwarder = Forwarder(dsn, {"billing": hanging})
    attempt = asyncio.create_task(forwarder.forward_all())
    try:
        await asyncio.wait_for(accepted.wait(), 30)
        await asyncio.sleep(0.5)
        open_transactions = await db.fetchval(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND xact_start IS NOT NULL"
        )
        assert open_transactions == 0
        assert not attempt.done()
    finally:
        attempt.cancel()
        await asyncio.gather(attempt, return_exceptions=True)
        await forwarder.close()
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
    assert len(await outbox(db)) == 1


# -- publish ----------------------------------------------------------------------------


async def test_publish_reaches_a_subscriber_in_another_database(
    dsn: str, dsn_b: str, db: asyncpg.Connection, db_b: asyncpg.Connection
) -> None:
    got: dict[str, list[int]] = {"billing": [], "audit": []}
    billing = Bus("billing", dsn=dsn_b, routes={"orders": dsn}, **fast())
    audit = Bus("audit", dsn=dsn, **fast())

    @billing.handler
    async def charge(msg: OrderPlaced, ctx: Context) -> None:
        got["billing"].append(msg.order_id)

    @audit.handler
    async def note(msg: OrderPlaced, ctx: Context) -> None:
        got["audit"].append(msg.order_id)

    billing.subscribe(OrderPlaced, publisher="orders")
    audit.subscribe(OrderPlaced, publisher="orders")
    orders = Bus("orders", dsn=dsn, routes={"billing": dsn_b}, **fast())
    orders.handler(OrderPlaced)(_ignore)
    async with billing, audit, orders:
        # The remote subscriber registered in the publisher's database.
        rows = await db.fetch(
            "SELECT subscriber_endpoint, subscriber_remote FROM nmbus.subscriptions "
            "ORDER BY subscriber_endpoint"
        )
        assert [tuple(r) for r in rows] == [("audit", False), ("billing", True)]
        assert await db_b.fetchval("SELECT count(*) FROM nmbus.subscriptions") == 0
        assert await orders.publish(OrderPlaced(order_id=7)) == ["audit", "billing"]
        await wait_until(lambda: got["billing"], what="billing's copy handled")
        await wait_until(lambda: got["audit"], what="audit's copy handled")
    assert got == {"billing": [7], "audit": [7]}
    assert await db.fetchval("SELECT to_regclass('nmbus.billing')") is None


async def test_a_remote_subscriber_the_publisher_has_no_route_for_waits_in_the_outbox(
    dsn: str, dsn_b: str, db: asyncpg.Connection, db_b: asyncpg.Connection
) -> None:
    billing = Bus("billing", dsn=dsn_b, routes={"orders": dsn}, concurrency=0)
    billing.subscribe(OrderPlaced, publisher="orders", permanent=True)
    async with billing:
        pass
    orders = Bus("orders", dsn=dsn, concurrency=0)  # no route for billing
    async with orders:
        await orders.publish(OrderPlaced(order_id=3), unique_id="p-3")
    # Never a local table for a subscriber that lives elsewhere.
    assert await db.fetchval("SELECT to_regclass('nmbus.billing')") is None
    assert [r["unique_id"] for r in await outbox(db)] == ["p-3/billing"]
    forwarder = Forwarder(dsn, {"billing": dsn_b})
    try:
        assert await forwarder.forward_all() == 1
    finally:
        await forwarder.close()
    assert await remote_ids(db_b) == ["p-3/billing"]


async def test_subscriptions_are_renewed_and_removed_in_the_publishers_database(
    dsn: str, dsn_b: str, db: asyncpg.Connection
) -> None:
    billing = Bus("billing", dsn=dsn_b, routes={"orders": dsn}, concurrency=0)
    billing.subscribe(OrderPlaced, publisher="orders")
    expiry = "SELECT expiration_date FROM nmbus.subscriptions WHERE subscriber_endpoint = 'billing'"
    async with billing:
        first = await db.fetchval(expiry)
        await db.execute("UPDATE nmbus.subscriptions SET expiration_date = now()")
        await billing.subscriptions.renew()
        assert await db.fetchval(expiry) > first
        await db.execute("DELETE FROM nmbus.subscriptions")
        await billing.subscriptions.renew()  # a renewal writes back a deleted row
        assert await db.fetchval(expiry) is not None
        await billing.unsubscribe(OrderPlaced, publisher="orders")
        assert await db.fetchval("SELECT count(*) FROM nmbus.subscriptions") == 0


async def test_the_renewer_keeps_a_remote_subscription_alive_by_itself(
    dsn: str, dsn_b: str, db: asyncpg.Connection
) -> None:
    # A lifetime of 1.5 s: the renewer writes every 0.5 s, in the publisher's database.
    billing = Bus("billing", dsn=dsn_b, routes={"orders": dsn}, concurrency=0, subscription_ttl=1.5)
    billing.subscribe(OrderPlaced, publisher="orders")
    expiry = "SELECT expiration_date FROM nmbus.subscriptions WHERE subscriber_endpoint = 'billing'"
    async with billing:
        first = await db.fetchval(expiry)
        seen = [first]

        async def moved_twice() -> bool:
            now = await db.fetchval(expiry)
            if now != seen[-1]:
                seen.append(now)
            return len(seen) >= 3

        await wait_until(moved_twice, timeout=15)
        assert seen == sorted(seen)
        # Still there long after its first lifetime ended.
        assert await db.fetchval(expiry) is not None


# -- schema -----------------------------------------------------------------------------


async def test_a_version_5_schema_gets_the_outbox_and_keeps_its_subscriptions(
    dsn: str, db: asyncpg.Connection
) -> None:
    await db.execute(
        """DROP TABLE nmbus.outbox;
           ALTER TABLE nmbus.subscriptions DROP COLUMN subscriber_remote;
           INSERT INTO nmbus.subscriptions (publisher_endpoint, subscriber_endpoint, message_type)
           VALUES ('orders', 'billing', 'x.T');
           UPDATE nmbus.schema_version SET version = 5"""
    )
    await install_schema(db, "nmbus")
    assert await db.fetchval("SELECT max(version) FROM nmbus.schema_version") == SCHEMA_VERSION
    assert await db.fetchval("SELECT count(*) FROM nmbus.outbox") == 0
    rows = await db.fetch("SELECT subscriber_endpoint, subscriber_remote FROM nmbus.subscriptions")
    assert [tuple(r) for r in rows] == [("billing", False)]


async def test_a_queue_named_outbox_stops_the_migration_clearly(
    dsn: str, db: asyncpg.Connection
) -> None:
    await db.execute(
        """DROP TABLE nmbus.outbox;
           CREATE TABLE nmbus.outbox (id bigint);
           INSERT INTO nmbus.queues (name) VALUES ('outbox');
           UPDATE nmbus.schema_version SET version = 5"""
    )
    with pytest.raises(asyncpg.RaiseError, match="rename the queue first"):
        await install_schema(db, "nmbus")
    assert await db.fetchval("SELECT max(version) FROM nmbus.schema_version") == 5


# -- status -----------------------------------------------------------------------------


async def test_status_shows_every_database_and_the_backlog(
    dsn: str, dsn_b: str, db: asyncpg.Connection
) -> None:
    orders = Bus("orders", dsn=dsn, routes={"billing": dsn_b, "ship": dsn_b}, concurrency=0)
    async with orders:
        for i in range(3):
            await orders.send(OrderPlaced(order_id=i), to="billing")
        await orders.send(OrderPlaced(order_id=9), to="ship")
    await db.execute("UPDATE nmbus.outbox SET insert_time = now() - interval '1 hour'")
    async with Admin(dsn) as admin:
        [route] = await admin.route_status({"billing": dsn_b, "ship": dsn_b})
    assert route.reachable is True
    assert [(q.queue, q.waiting) for q in route.queues] == [("billing", 3), ("ship", 1)]
    assert all(q.oldest_seconds is not None and q.oldest_seconds >= 3600 for q in route.queues)


# -- command line -----------------------------------------------------------------------


@pytest.fixture
def _keep_logging_config() -> Iterator[None]:
    """The CLI configures structlog for the process; give other tests theirs back."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


async def invoke(*argv: str, env: dict[str, str | None], code: int = 0) -> Any:
    result = await asyncio.to_thread(
        CliRunner().invoke, app, list(argv), env={"COLUMNS": "200", **env}
    )
    assert result.exit_code == code, (argv, result.stdout, result.stderr, result.exception)
    return result


@pytest.mark.usefixtures("_keep_logging_config")
async def test_status_and_forward_on_the_command_line(
    dsn: str, dsn_b: str, db_b: asyncpg.Connection
) -> None:
    orders = Bus("orders", dsn=dsn, routes={"billing": dsn_b}, concurrency=0)
    async with orders:
        await orders.send(OrderPlaced(order_id=1), to="billing")
        await orders.send(OrderPlaced(order_id=2), to="lost")  # not routed: a local queue
    # A row for a queue this configuration has no route for (written by another service).
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "INSERT INTO nmbus.outbox (to_endpoint, from_endpoint, unique_id) "
            "VALUES ('elsewhere', 'orders', 'e-1')"
        )
    finally:
        await conn.close()
    env: dict[str, str | None] = {
        "NMBUS_DSN": dsn,
        "NMBUS_ROUTES": "billing=b",
        "NMBUS_DB_B": dsn_b.replace("postgres@", "postgres:s3cret@"),
    }
    got = json.loads((await invoke("status", "--json", env=env)).stdout)
    remote, lost = got["routes"]
    assert remote["reachable"] is True and "s3cret" not in remote["database"]
    assert [(q["queue"], q["waiting"]) for q in remote["queues"]] == [("billing", 1)]
    assert lost["database"] is None and lost["queues"][0]["queue"] == "elsewhere"
    text = (await invoke("status", env=env)).stdout
    assert "routes:" in text and "billing" in text and "s3cret" not in text
    out = (await invoke("forward", "--once", env=env)).stdout
    assert "forwarded 1 message(s) to 1 database(s)" in out
    assert len(await remote_ids(db_b)) == 1
    bad = await invoke("forward", "--once", env={**env, "NMBUS_ROUTES": "billing=c"}, code=2)
    assert "NMBUS_DB_C" in bad.stderr and "s3cret" not in bad.stderr


# -- sample -----------------------------------------------------------------------------


def test_the_routes_sample_runs(dsn: str, dsn_b: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "samples.routes"],
        cwd=ROOT,
        env={**os.environ, "NMBUS_DSN": dsn, "NMBUS_DB_B": dsn_b},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for n in (1, 2, 3):
        assert f"[billing] saw order {n} (published in the other database)" in result.stdout
        assert f"[orders] order {n} charged (from billing)" in result.stdout
    assert "[orders] all 3 orders charged across two databases" in result.stdout
    # The sample's own lines only: no debug or info line of the library's.
    assert not re.search(r"\[(debug|info) *\]", result.stdout + result.stderr), result.stdout


# -- bench ------------------------------------------------------------------------------


async def test_the_routed_bench_measures_both_ways_and_leaves_nothing_behind(
    dsn: str, db: asyncpg.Connection
) -> None:
    from bench.modes import Options, run

    databases = "SELECT datname FROM pg_database WHERE datname LIKE 'nmbus_bench_%'"
    before = {r[0] for r in await db.fetch(databases)}
    options = Options(dsn=dsn, messages=200, batch_size=50, rate=50.0, seconds=0.5, warmup=0.1)
    [result] = await run(["routed"], options)
    figures = result.figures
    for name in ("local_p50_ms", "routed_p50_ms", "local_p99_ms", "routed_p99_ms"):
        assert figures[name] > 0
    assert figures["local_messages_per_s"] > 0 and figures["routed_messages_per_s"] > 0
    assert figures["burst_messages"] == 200
    assert result.settings["rate_per_s"] == 50.0
    # Its scratch schema and its second database are gone.
    schemas = await db.fetch("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'nmbus_bench_%'")
    assert schemas == []
    assert {r[0] for r in await db.fetch(databases)} <= before
