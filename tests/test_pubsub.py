"""Publish/subscribe against a real PostgreSQL, with endpoints in separate processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

import asyncpg
import pytest
import structlog

from nmbus import Bus, Context, Message
from nmbus.errors import ConfigurationError
from nmbus.testing import MemoryStore, drain
from tests import procs
from tests.messages import Event, OrderPlaced, Ping
from tests.pubsub_workers import Event as PsEvent
from tests.pubsub_workers import order_placed
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parent.parent

RECEIVED = """
CREATE TABLE received (
    endpoint text, unique_id text, correlation_id text, label text, decoded_as text, n int
)
"""


class Proc(procs.Proc):
    def __init__(self, *args: str) -> None:
        super().__init__("tests.pubsub_workers", *args)


@asynccontextmanager
async def processes(*procs: Proc) -> AsyncIterator[None]:
    try:
        for proc in procs:
            await proc.wait_for("ready")
        yield
    finally:
        for proc in procs:
            proc.kill()


async def queue_rows(db: asyncpg.Connection, queue: str) -> list[asyncpg.Record]:
    if not await db.fetchval("SELECT to_regclass(format('nmbus.%I', $1::text))", queue):
        return []
    return await db.fetch(f'SELECT * FROM nmbus."{queue}" ORDER BY id')


# -- the required tests ----------------------------------------------------------


async def test_a_publish_reaches_exactly_the_two_subscribers_once_each(
    dsn: str, db: asyncpg.Connection
) -> None:
    await db.execute(RECEIVED)
    billing = Proc("subscriber", dsn, "billing", "60", "orders:ps.OrderPlaced")
    shipping = Proc("subscriber", dsn, "shipping", "60", "orders:ps.Event")  # the base class
    # A running endpoint with subscriptions that do not match: another type, another publisher.
    audit = Proc("subscriber", dsn, "audit", "60", "orders:ps.Refund", "invoicing:ps.OrderPlaced")
    async with processes(billing, shipping, audit):
        orders = Proc("publisher", dsn, "orders", "20")
        try:
            await orders.wait_for("done")
        finally:
            orders.kill()
        assert [line.split()[2] for line in orders.lines if line.startswith("published")] == [
            "billing,shipping"
        ] * 20

        await wait_until("SELECT count(*) FROM received", db=db, until=lambda count: count >= 40)
        await asyncio.sleep(1.0)  # room for a duplicate or a stray copy to show up
    received = await db.fetch("SELECT * FROM received ORDER BY endpoint, n")
    by_endpoint: dict[str, list[int]] = {}
    for r in received:
        by_endpoint.setdefault(r["endpoint"], []).append(r["n"])
    assert by_endpoint == {"billing": list(range(20)), "shipping": list(range(20))}
    assert await queue_rows(db, "audit") == []
    # Each copy has its own unique_id; both copies of one publish share the correlation id.
    assert len({r["unique_id"] for r in received}) == 40
    for n in range(20):
        pair = [r for r in received if r["n"] == n]
        assert pair[0]["correlation_id"] == pair[1]["correlation_id"]
        assert pair[0]["unique_id"].rsplit("/", 1)[0] == pair[1]["unique_id"].rsplit("/", 1)[0]
    assert {(r["label"], r["decoded_as"]) for r in received} == {("ps.OrderPlaced",) * 2}


async def test_a_base_class_subscription_receives_subclasses(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    shipping = make_bus("shipping")
    seen: list[tuple[str, str | None]] = []

    @shipping.handler
    async def on_event(msg: Event, ctx: Context) -> None:
        seen.append((type(msg).__name__, ctx.label))

    shipping.subscribe(Event, publisher="orders")
    async with shipping, make_bus("orders", concurrency=0) as orders:
        assert await orders.publish(OrderPlaced(name="o", order_id=1)) == ["shipping"]
        assert await orders.publish(Event(name="plain")) == ["shipping"]
        assert await orders.publish(Ping(n=1)) == []  # not in Event's chain
        await drain(shipping)
    assert seen == [("OrderPlaced", "test.OrderPlaced"), ("Event", "test.Event")]


async def test_a_subscriber_that_only_knows_the_base_class_decodes_the_subclass_as_it(
    dsn: str, db: asyncpg.Connection, make_bus: Callable[..., Bus]
) -> None:
    await db.execute(RECEIVED)
    shipping = Proc("subscriber", dsn, "shipping", "60", "base-only", "orders:ps.Event")
    async with processes(shipping):
        async with make_bus("orders", concurrency=0) as orders:
            assert await orders.publish(order_placed()(n=7, order_id=70)) == ["shipping"]

        await wait_until("SELECT count(*) FROM received", db=db)
    (row,) = await db.fetch("SELECT * FROM received")
    assert (row["label"], row["decoded_as"], row["n"]) == ("ps.OrderPlaced", "ps.Event", 7)
    (stored,) = await queue_rows(db, "shipping")
    assert stored["subqueue"] == "X"


async def test_a_subscriber_that_stops_renewing_stops_receiving_and_a_renewing_one_never_misses(
    dsn: str, db: asyncpg.Connection, make_bus: Callable[..., Bus]
) -> None:
    ttl = 3.0
    await db.execute(RECEIVED)
    alive = Proc("subscriber", dsn, "alive", str(ttl), "orders:ps.Event")
    doomed = Proc("subscriber", dsn, "doomed", str(ttl), "orders:ps.Event")
    published: list[tuple[int, list[str]]] = []
    async with processes(alive, doomed), make_bus("orders", concurrency=0) as orders:
        n = 0

        async def publish_for(seconds: float) -> None:
            nonlocal n
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                published.append((n, await orders.publish(PsEvent(n=n))))
                n += 1
                await asyncio.sleep(0.05)

        await publish_for(1.0)
        doomed.kill()
        killed_at = await db.fetchval("SELECT now()")
        killed_n = n
        # Its last renewal is final once the server has finished what the process sent
        # before it died (a renewal may still commit just after the kill): read it when
        # it has stood still for half a second (the row is purged one lifetime after expiry).
        expiry_of = (
            "SELECT expiration_date FROM nmbus.subscriptions WHERE subscriber_endpoint = 'doomed'"
        )

        async def settled_expiry() -> object:
            first = await db.fetchval(expiry_of)
            await asyncio.sleep(0.5)
            return first if first == await db.fetchval(expiry_of) else None

        expiry = await wait_until(
            settled_expiry,
            until=lambda value: value is not None,
            what="the killed subscriber's last renewal to settle",
        )
        # Keep publishing over more than two lifetimes: 'alive' renews, 'doomed' cannot.
        await publish_for(2 * ttl + 1.0)

        await wait_until("SELECT count(*) FROM received", db=db, until=lambda count: count >= n)

    # The renewing subscriber got every single publish.
    got = [r["n"] for r in await db.fetch("SELECT n FROM received WHERE endpoint = 'alive'")]
    assert sorted(got) == list(range(n))
    assert all("alive" in subs for _, subs in published)

    # The killed one's queue kept filling while its subscription lived (a restart
    # would lose nothing), then stopped: no copy stored after its expiry.
    doomed_rows = await queue_rows(db, "doomed")
    assert killed_at < expiry <= killed_at + timedelta(seconds=ttl)
    assert any(r["insert_time"] > killed_at for r in doomed_rows)
    assert all(r["insert_time"] < expiry for r in doomed_rows)
    stopped_at = max(n for n, subs in published if "doomed" in subs)
    assert stopped_at >= killed_n
    assert all("doomed" not in subs for n, subs in published if n > stopped_at)
    assert len([1 for n, _ in published if n > stopped_at]) > 10  # and it really was left out


async def test_publish_in_a_caller_transaction_that_rolls_back_leaves_nothing(
    dsn: str, db: asyncpg.Connection, make_bus: Callable[..., Bus]
) -> None:
    billing = make_bus("billing", concurrency=0)
    billing.subscribe(OrderPlaced, publisher="orders")
    shipping = make_bus("shipping", concurrency=0)
    shipping.subscribe(Event, publisher="orders")
    async with billing, shipping, make_bus("orders", concurrency=0) as orders:
        # A subscriber whose queue table does not exist yet.
        await orders.store.subscribe("orders", "ghost", ["test.Event"], None)
        conn = await asyncpg.connect(dsn)
        try:
            tx = conn.transaction()
            await tx.start()
            subs = await orders.publish(OrderPlaced(name="a", order_id=1), connection=conn)
            assert subs == ["billing", "ghost", "shipping"]
            await orders.publish_many(
                [OrderPlaced(name="b", order_id=2), Event(name="c")], connection=conn
            )
            await tx.rollback()
            for queue in ("billing", "shipping", "ghost"):
                assert await queue_rows(db, queue) == []
            assert await db.fetchval("SELECT to_regclass('nmbus.ghost')") is None

            async with conn.transaction():
                await orders.publish(OrderPlaced(name="d", order_id=4), connection=conn)
                assert await queue_rows(db, "billing") == []  # not before the commit
        finally:
            await conn.close()
    for queue in ("billing", "shipping", "ghost"):
        assert [r["label"] for r in await queue_rows(db, queue)] == ["test.OrderPlaced"]
    assert "ghost" in [r["name"] for r in await db.fetch("SELECT name FROM nmbus.queues")]


async def test_a_new_subscriber_receives_the_first_publish_after_its_subscription_committed(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    async with make_bus("orders", concurrency=0) as orders:
        assert await orders.publish(Event(name="before anyone listens")) == []
        for i in range(10):
            subscriber = make_bus(f"late{i}", concurrency=0)
            subscriber.subscribe(Event, publisher="orders")
            async with subscriber:  # the subscription is committed when start returns
                subs = await orders.publish(Event(name=f"first after late{i}"))
            assert f"late{i}" in subs
            rows = await queue_rows(db, f"late{i}")
            assert [r["msg_text"] for r in rows] == [f'{{"name":"first after late{i}"}}']


# -- more of the contract ------------------------------------------------------------------


async def test_handler_publishes_commit_with_the_handler(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    billing = make_bus("billing", max_attempts=1, batch_size=50)

    @billing.handler
    async def charge(msg: Ping, ctx: Context) -> None:
        await ctx.publish(OrderPlaced(name="paid", order_id=msg.n))
        if msg.n % 3 == 0:
            raise ValueError("declined")

    shipping = make_bus("shipping", concurrency=0)
    shipping.subscribe(OrderPlaced, publisher="billing")
    audit = make_bus("audit", concurrency=0)
    audit.subscribe(Event, publisher="billing")
    async with shipping, audit, billing, make_bus("orders", concurrency=0) as orders:
        for n in range(1, 31):
            await orders.send(Ping(n=n), to="billing", correlation_id=f"corr-{n}")
        await drain(billing)
    expected = [n for n in range(1, 31) if n % 3]
    for queue in ("shipping", "audit"):
        rows = await queue_rows(db, queue)
        assert sorted(int(r["msg_text"].split(":")[-1].rstrip("}")) for r in rows) == expected
        assert sorted(r["correlation_id"] for r in rows) == sorted(f"corr-{n}" for n in expected)
        assert all(r["from_endpoint"] == "billing" for r in rows)


async def test_fan_out_is_one_statement_whatever_the_number_of_subscribers(
    dsn: str, make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    subscribers = []
    for i in range(8):
        bus = make_bus(f"sub{i}", concurrency=0)
        bus.subscribe(Event, publisher="orders")
        subscribers.append(bus)
    for bus in subscribers:
        await bus.start()
    try:
        async with make_bus("orders", concurrency=0) as orders:
            conn = await asyncpg.connect(dsn)
            statements: list[str] = []
            conn.add_query_logger(lambda record: statements.append(record.query))
            try:
                async with conn.transaction():
                    # Warm up: asyncpg prepares the statement and looks up its types once.
                    await orders.publish(Ping(n=0), connection=conn)
                    # asyncpg calls the logger soon after a statement, not at once:
                    # those of all statements so far together, on the loop's next turn.
                    await wait_until(lambda: statements, what="the warm-up logged")
                    statements.clear()
                    subs = await orders.publish(Event(name="x"), connection=conn)
                    copies = await orders.publish_many(
                        [Event(name=str(n)) for n in range(100)], connection=conn
                    )
                    await wait_until(lambda: statements, what="the publishes logged")
                    assert len(statements) == 2, statements
            finally:
                await conn.close()
    finally:
        for bus in subscribers:
            await bus.stop()
    assert subs == [f"sub{i}" for i in range(8)]
    assert copies == {f"sub{i}": 100 for i in range(8)}
    rows = await queue_rows(db, "sub5")
    assert [r["msg_text"] for r in rows[1:]] == [f'{{"name":"{n}"}}' for n in range(100)]


async def test_republishing_a_unique_id_stores_one_copy_per_subscriber(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    billing = make_bus("billing", concurrency=0)
    billing.subscribe(Event, publisher="orders")
    async with billing, make_bus("orders", concurrency=0) as orders:
        await orders.publish(Event(name="a"), unique_id="evt-1", correlation_id="c-1")
        await orders.publish(Event(name="a"), unique_id="evt-1", correlation_id="c-1")
    (row,) = await queue_rows(db, "billing")
    assert (row["unique_id"], row["correlation_id"]) == ("evt-1/billing", "c-1")


async def test_subscription_rows_lifetime_permanent_and_unsubscribe(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", concurrency=0, subscription_ttl=600)
    bus.subscribe(OrderPlaced, publisher="orders")
    bus.subscribe(Ping, publisher="orders", permanent=True)
    await bus.unsubscribe(Event, publisher="orders")  # before start: applied at start
    await db.execute(
        "INSERT INTO nmbus.subscriptions (publisher_endpoint, subscriber_endpoint, message_type) "
        "VALUES ('orders', 'billing', 'test.Event')"
    )
    query = (
        "SELECT message_type, extract(epoch FROM expiration_date - created_date) AS life "
        "FROM nmbus.subscriptions ORDER BY message_type"
    )
    async with bus:
        rows = [(r["message_type"], r["life"]) for r in await db.fetch(query)]
        assert rows[0][0] == "test.OrderPlaced" and 599 < rows[0][1] <= 600
        assert rows[1] == ("test.Ping", None)
        assert len(rows) == 2  # the stale test.Event row is gone
        with pytest.raises(ConfigurationError, match="before"):
            bus.subscribe(Event, publisher="orders")
        await bus.unsubscribe(Ping, publisher="orders")
        assert [r["message_type"] for r in await db.fetch(query)] == ["test.OrderPlaced"]


async def test_renewal_rewrites_a_deleted_row_and_purges_long_expired_ones(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    await db.execute(
        "INSERT INTO nmbus.subscriptions (publisher_endpoint, subscriber_endpoint, message_type,"
        " expiration_date) VALUES ('orders', 'gone', 'test.Event', now() - interval '1 hour')"
    )
    query = (
        "SELECT subscriber_endpoint, message_type, "
        "extract(epoch FROM expiration_date - now()) AS left FROM nmbus.subscriptions "
        "ORDER BY subscriber_endpoint"
    )
    bus = make_bus("billing", concurrency=0, subscription_ttl=0.6)
    bus.subscribe(Event, publisher="orders")
    async with bus:
        await db.execute("DELETE FROM nmbus.subscriptions WHERE subscriber_endpoint = 'billing'")
        assert [r[0] for r in await db.fetch(query)] in (["gone"], [])  # [] if already purged

        async def subscribers() -> list[str]:
            return [r[0] for r in await db.fetch(query)]

        # The deleted row renewed, the long-expired one purged.
        await wait_until(subscribers, until=lambda found: found == ["billing"], timeout=10)
        rows = [tuple(r) for r in await db.fetch(query)]
    # The deleted row is back as declared, expiring within a lifetime (not permanent);
    # the row that expired an hour ago (its subscriber long gone) is removed.
    [(subscriber, message_type, left)] = rows
    assert (subscriber, message_type) == ("billing", "test.Event")
    assert left is not None and left <= 0.6


async def test_publishing_without_subscribers_succeeds_and_says_so(
    make_bus: Callable[..., Bus],
) -> None:
    with structlog.testing.capture_logs() as logs:
        async with make_bus("orders", concurrency=0) as orders:
            assert await orders.publish(Event(name="x")) == []
            assert await orders.publish_many([Event(name="y")]) == {}
    events = [e for e in logs if e["event"] == "published_without_subscribers"]
    assert [e["messages"] for e in events] == [1, 1]


async def test_the_memory_store_publishes_like_postgres() -> None:
    store = MemoryStore()
    billing = Bus("billing", store=store, poll_interval=0.05)
    seen: list[tuple[str, str | None]] = []

    @billing.handler
    async def on_event(msg: Event, ctx: Context) -> None:
        seen.append((type(msg).__name__, ctx.correlation_id))
        await ctx.publish(Ping(n=1))

    billing.subscribe(Event, publisher="orders")
    audit = Bus("audit", store=store, concurrency=0)
    audit.subscribe(Ping, publisher="billing")
    async with audit, billing, Bus("orders", store=store, concurrency=0) as orders:
        assert await orders.publish(OrderPlaced(name="o", order_id=1), correlation_id="c") == [
            "billing"
        ]
        await drain(billing)
    assert seen == [("OrderPlaced", "c")]
    (row,) = store.rows("audit")
    assert (row.label, row.correlation_id, row.unique_id.endswith("/audit")) == (
        "test.Ping",
        "c",
        True,
    )


def test_subscribe_checks_its_arguments_at_once() -> None:
    bus = Bus("billing", store=MemoryStore())
    with pytest.raises(ConfigurationError):
        bus.subscribe(int, publisher="orders")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        bus.subscribe(Message, publisher="orders")
    with pytest.raises(ConfigurationError):
        bus.subscribe(Event, publisher="no such name!")
