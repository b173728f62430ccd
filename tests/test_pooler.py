"""nmbus behind PgBouncer in transaction mode (docs/deployment.md, "Behind PgBouncer").

Every test here starts the machine's pgbouncer (Debian's package, bench/pgbouncer.py)
in front of the test server, with fewer server connections than nmbus opens client
connections, so that consecutive transactions of one client run on different
server connections: whatever relied on a session's state breaks. The pooler's
own counters (SHOW STATS) show that the traffic went through it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from urllib.parse import urlsplit

import asyncpg
import pytest
from pydantic import BaseModel
from structlog.testing import capture_logs

from bench.pgbouncer import PgBouncer, find_pgbouncer
from nmbus import Bus, Context, Message
from nmbus.errors import DatabaseUnavailable, InvalidSetting, RetryLater
from nmbus.ops.admin import Admin
from nmbus.ports.operations import RetentionPolicy
from nmbus.postgres.pooler import Pooler
from nmbus.settings import build_settings
from nmbus.testing import drain
from tests.messages import OrderPlaced, Ping, Posted
from tests.pg import Databases
from tests.waits import wait_until

#: Server connections the pooler keeps per database: fewer than nmbus's client
#: connections (two worker loops, the lease connection, a send pool of four),
#: lent in turn (server_round_robin), so that a client's next transaction runs on
#: another server connection than its last.
SERVER_CONNECTIONS = 3


def _server() -> str:
    return os.environ.get("NMBUS_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")


def _pgbouncer_or_skip() -> None:
    try:
        find_pgbouncer()
    except RuntimeError:
        if os.environ.get("NMBUS_TEST_STRICT"):
            raise  # CI installs pgbouncer (.ci/run): its absence is a failure there
        pytest.skip("no pgbouncer on this machine (apt-get install pgbouncer)")


@pytest.fixture(scope="module")
def bouncer() -> Iterator[PgBouncer]:
    _pgbouncer_or_skip()
    bouncer = PgBouncer(_server(), "transaction", SERVER_CONNECTIONS, round_robin=True)
    with bouncer as running:
        yield running


def database(dsn: str) -> str:
    return urlsplit(dsn).path.lstrip("/")


@pytest.fixture
def pooled(bouncer: PgBouncer, dsn: str) -> str:
    """The test database's DSN through the pooler."""
    bouncer.check()
    return bouncer.dsn(database(dsn))


def transactions(bouncer: PgBouncer, db: str) -> int:
    """Transactions the pooler has run for database ``db`` (its SHOW STATS)."""
    for row in bouncer.show("STATS"):
        if row["database"] == db:
            return int(row["total_xact_count"])
    return 0


def pooler_bus(endpoint: str, pooled: str, **overrides: object) -> Bus:
    settings: dict[str, object] = {
        "pooler": "transaction",
        "poll_interval": 0.1,
        "lease_seconds": 10.0,
        "concurrency": 2,
        "send_pool_size": 4,
        "retry_delay": 0.05,
    }
    settings.update(overrides)
    return Bus(endpoint, dsn=pooled, **settings)


# -- refused without the setting -------------------------------------------------------


@pytest.mark.parametrize("concurrency", [2, 0], ids=["worker", "send-only"])
async def test_without_the_setting_a_transaction_pooler_is_refused_at_start(
    pooled: str, concurrency: int
) -> None:
    bus = Bus("orders", dsn=pooled, concurrency=concurrency)
    with pytest.raises(InvalidSetting, match="set NMBUS_POOLER=transaction"):
        await bus.start()
    assert not bus.worker.in_flight


async def test_a_session_pooler_is_not_mistaken_for_a_transaction_pooler(dsn: str) -> None:
    _pgbouncer_or_skip()
    with PgBouncer(_server(), "session", pool_size=SERVER_CONNECTIONS * 4) as session:
        handled: list[int] = []
        bus = Bus("orders", dsn=session.dsn(database(dsn)), concurrency=1, poll_interval=30)

        @bus.handler
        async def on_ping(msg: Ping, ctx: Context) -> None:
            handled.append(msg.n)

        async with bus:
            await bus.send(Ping(n=1), to="orders")
            # Woken by its NOTIFY: LISTEN works through a session pooler.
            await wait_until(lambda: handled == [1], timeout=20)


async def test_a_listen_dsn_that_does_not_bypass_the_pooler_is_refused_at_start(
    pooled: str, databases: Databases
) -> None:
    # The pooler itself, and a direct DSN of another database: neither hears the NOTIFYs.
    with databases.fresh() as other:
        for deaf in (pooled, other):
            bus = pooler_bus("orders", pooled, listen_dsn=deaf)
            with pytest.raises(InvalidSetting, match=r"listen_dsn .* must reach the same database"):
                await bus.start()
    # One that cannot be reached says which, without its password.
    bus = pooler_bus("orders", pooled, listen_dsn="postgresql://app:TopS3cretPW@127.0.0.1:1/x")
    with pytest.raises(DatabaseUnavailable, match="cannot connect to") as refused:
        await bus.start()
    assert "127.0.0.1:1/x" in str(refused.value) and "TopS3cretPW" not in str(refused.value)


async def test_a_prepared_statement_lost_to_a_pooler_says_to_set_it(
    bouncer: PgBouncer, pooled: str
) -> None:
    """Past the start (a pooler put in front later): the error says what to set."""
    from nmbus.postgres import PostgresStore
    from nmbus.postgres.connections import open_pool

    store = PostgresStore(pooled, pooler=Pooler("transaction"))  # starts as told...
    await store.open()
    try:
        await store.ensure_queue("orders")
        # ... and then sends as a direct connection would, with named statements.
        store.pooler = Pooler()
        await store._pool.close()  # type: ignore[union-attr]
        store._pool = await open_pool(pooled, 4, Pooler())
        with pytest.raises(Exception, match="set NMBUS_POOLER=transaction"):
            await asyncio.gather(*(store.counts("orders") for _ in range(40)))
    finally:
        await store.close()


async def test_worker_connections_plan_generically_unless_behind_a_transaction_pooler(
    dsn: str, pooled: str
) -> None:
    """The worker's plan_cache_mode is a SET once connected (PgBouncer refuses it as a
    startup parameter in every pool mode); behind a transaction pooler it is not set."""
    from nmbus.postgres import PostgresStore

    for store, mode in (
        (PostgresStore(dsn), "force_generic_plan"),
        (PostgresStore(pooled, pooler=Pooler("transaction")), "auto"),
    ):
        conn = await store.connect()
        try:
            assert await conn.fetchval("SHOW plan_cache_mode") == mode
        finally:
            await conn.close()


def test_listen_dsn_needs_the_pooler_setting_and_keeps_its_password() -> None:
    secret = "postgresql://app:TopS3cretPW@127.0.0.1:5432/x"
    with pytest.raises(InvalidSetting, match=r"listen_dsn.*pooler=transaction") as refused:
        build_settings(listen_dsn=secret)
    assert "TopS3cretPW" not in str(refused.value)
    assert "TopS3cretPW" not in repr(build_settings(pooler="transaction", listen_dsn=secret))
    assert build_settings(pooler="transaction").pooler == "transaction"
    with pytest.raises(InvalidSetting, match="pooler"):
        build_settings(pooler="session")


# -- everything works through it --------------------------------------------------------


async def test_sends_handlers_and_retries_through_the_pooler(
    bouncer: PgBouncer, pooled: str, db: asyncpg.Connection
) -> None:
    await db.execute("CREATE TABLE effects (n int PRIMARY KEY)")
    tried: dict[int, int] = {}
    bus = pooler_bus("orders", pooled, handler_concurrency=4)

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        tried[msg.n] = tried.get(msg.n, 0) + 1
        if msg.n % 5 == 0 and tried[msg.n] == 1:
            raise RuntimeError("first attempt fails")
        if msg.n % 7 == 0 and tried[msg.n] == 1:
            raise RetryLater(0.05)
        await ctx.connection.execute("INSERT INTO effects VALUES ($1)", msg.n)
        if msg.n < 20:
            await ctx.send(Ping(n=1000 + msg.n), to="orders")  # a send from a handler

    before = transactions(bouncer, database(pooled))
    async with bus:
        await asyncio.gather(*(bus.send(Ping(n=n), to="orders") for n in range(200)))
        async with bus.store.pool.acquire() as conn, conn.transaction():  # type: ignore[attr-defined]
            await bus.send(Ping(n=500), to="orders", connection=conn)
        # Retries wait in R a little while: wait for every effect, then for the rest.
        await wait_until("SELECT count(*) FROM effects", db=db, until=lambda n: n >= 221)
        await drain(bus, timeout=60)
    expected = {*range(200), 500, *(1000 + n for n in range(20))}
    assert {r[0] for r in await db.fetch("SELECT n FROM effects")} == expected
    counts = dict(await db.fetch("SELECT subqueue, count(*) FROM nmbus.orders GROUP BY 1"))
    assert counts == {"X": len(expected)}
    assert transactions(bouncer, database(pooled)) - before > len(expected)


async def test_wakeups_poll_behind_the_pooler_without_listen_dsn(
    bouncer: PgBouncer, pooled: str
) -> None:
    handled: list[int] = []
    bus = pooler_bus("orders", pooled, concurrency=1, poll_interval=0.2)

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        handled.append(msg.n)

    with capture_logs() as logs:
        async with bus:
            await wait_until(lambda: any(e["event"] == "listener_off" for e in logs))
            await bus.send(Ping(n=1), to="orders")
            await wait_until(lambda: handled == [1], timeout=20)


async def test_listen_dsn_wakes_the_worker_past_the_pooler(
    bouncer: PgBouncer, pooled: str, dsn: str, db: asyncpg.Connection
) -> None:
    handled: list[int] = []
    # A poll so rare that only the NOTIFY, received on the direct DSN, can wake it in time.
    bus = pooler_bus("orders", pooled, concurrency=1, poll_interval=120, listen_dsn=dsn)

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        handled.append(msg.n)

    async with bus:
        await wait_until(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND query LIKE 'LISTEN %' AND pid <> pg_backend_pid()",
            db=db,
        )
        await asyncio.sleep(0.3)  # the first claim has found nothing: the loop waits
        await bus.send(Ping(n=7), to="orders")
        await wait_until(lambda: handled == [7], timeout=30)


class Paid(Message, type_name="test.pooler.Paid"):
    order_id: int


class Order(BaseModel):
    order_id: int = 0
    paid: bool = False


async def test_pubsub_sagas_flow_limits_and_sequences_through_the_pooler(
    bouncer: PgBouncer, pooled: str, db: asyncpg.Connection
) -> None:
    await db.execute(
        "CREATE TABLE seen (kind text, n int, at timestamptz DEFAULT clock_timestamp())"
    )
    orders = pooler_bus("orders", pooled, handler_concurrency=4)
    saga = orders.saga(Order, key="order_id")

    @saga.handler(start=True)
    async def placed(msg: OrderPlaced, state: Order, ctx: Context) -> None:
        state.order_id = msg.order_id
        await ctx.connection.execute(
            "INSERT INTO seen (kind, n) VALUES ('placed', $1)", msg.order_id
        )

    @saga.handler
    async def paid(msg: Paid, state: Order, ctx: Context) -> None:
        state.paid = True
        ctx.saga.complete()
        await ctx.connection.execute("INSERT INTO seen (kind, n) VALUES ('paid', $1)", msg.order_id)

    billing = pooler_bus("billing", pooled, handler_concurrency=4)

    @billing.handler(concurrency=1)
    async def limited(msg: Ping, ctx: Context) -> None:
        await ctx.connection.execute("INSERT INTO seen (kind, n) VALUES ('ping', $1)", msg.n)
        await asyncio.sleep(0.01)
        await ctx.connection.execute("INSERT INTO seen (kind, n) VALUES ('ping_end', $1)", msg.n)

    @billing.handler
    async def member(msg: Posted, ctx: Context) -> None:
        await ctx.connection.execute("INSERT INTO seen (kind, n) VALUES ($1, $2)", msg.seq, msg.n)

    billing.subscribe(OrderPlaced, "orders")

    @billing.handler
    async def on_placed(msg: OrderPlaced, ctx: Context) -> None:
        await ctx.connection.execute(
            "INSERT INTO seen (kind, n) VALUES ('published', $1)", msg.order_id
        )

    async with billing, orders:
        for n in range(10):
            await orders.publish(OrderPlaced(order_id=n, name="o"))  # to billing
            await orders.send(OrderPlaced(order_id=n, name="o"), to="orders")  # the saga
        await asyncio.gather(*(billing.send(Ping(n=n), to="billing") for n in range(20)))
        for n in range(15):
            await billing.send(Posted(seq="acct", n=n), to="billing", sequence="acct")
        await drain(orders, timeout=60)
        for n in range(10):
            await orders.send(Paid(order_id=n), to="orders")
        await drain(orders, timeout=60)
        await drain(billing, timeout=60)

    def kind(name: str) -> list[int]:
        return [r["n"] for r in rows if r["kind"] == name]

    rows = await db.fetch("SELECT kind, n FROM seen ORDER BY at")
    assert sorted(kind("published")) == list(range(10))  # each subscriber copy once
    assert sorted(kind("placed")) == list(range(10))
    assert sorted(kind("paid")) == list(range(10))
    assert await db.fetchval('SELECT count(*) FROM nmbus."orders$saga"') == 0  # completed
    assert kind("acct") == list(range(15))  # the sequence in send order
    pings = [(r["kind"], r["n"]) for r in rows if r["kind"] in ("ping", "ping_end")]
    assert len(pings) == 40
    # concurrency=1: each limited handler ends before the next one starts.
    assert all(pings[i][1] == pings[i + 1][1] for i in range(0, 40, 2)), pings


def lock_states(dsn: str, key: str) -> str:
    """The states of the sessions holding advisory lock ``key`` (psql: synchronous, so
    a retention run's progress callback can look while the run waits for it)."""
    sql = (
        "SELECT coalesce(string_agg(a.state, ','), '') FROM pg_locks l "
        "JOIN pg_stat_activity a USING (pid) WHERE l.locktype = 'advisory' "
        f"AND l.objid = hashtext('{key}')::oid AND l.granted"
    )
    out = subprocess.run(
        ["psql", "-X", "-A", "-t", "-c", sql, dsn], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


async def test_retention_through_the_pooler_holds_its_one_run_lock_in_a_transaction(
    bouncer: PgBouncer, pooled: str, dsn: str, db: asyncpg.Connection
) -> None:
    async with pooler_bus("orders", pooled, concurrency=0) as bus:
        await asyncio.gather(*(bus.send(Ping(n=n), to="orders") for n in range(30)))
    await db.execute(
        "UPDATE nmbus.orders SET subqueue = 'X', last_processed = now() - interval '30 days'"
    )
    key = "nmbus.retention.nmbus.orders"
    policy = RetentionPolicy(max_age=timedelta(days=7), batch_size=10)
    seen: list[str] = []

    def on_batch(queue: str, rows: int) -> None:
        seen.append(lock_states(dsn, key))

    async with Admin(pooled, pooler="transaction") as admin:
        # A run of a process connected directly holds the queue: this one is skipped.
        other = await asyncpg.connect(dsn)
        try:
            assert await other.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", key)
            (result,) = await admin.run_retention(policy, ["orders"], on_batch)
            assert result.skipped
            assert await db.fetchval("SELECT count(*) FROM nmbus.orders") == 30
        finally:
            await other.close()
        (result,) = await admin.run_retention(policy, ["orders"], on_batch)
    assert not result.skipped
    assert await db.fetchval("SELECT count(*) FROM nmbus.orders") == 0
    # While the run worked its lock was held by a transaction left open for it (a
    # session lock behind the pooler would be held by an idle server connection the
    # pooler lends to anyone, and stay there); afterwards nobody holds it.
    assert seen and set(seen) == {"idle in transaction"}, seen
    assert lock_states(dsn, key) == ""


async def test_the_forwarder_moves_the_outbox_through_the_pooler(
    bouncer: PgBouncer, pooled: str, databases: Databases
) -> None:
    with databases.fresh() as remote:
        remote_pooled = bouncer.dsn(database(remote))
        handled: list[int] = []
        billing = pooler_bus("billing", remote_pooled, concurrency=1)

        @billing.handler
        async def on_ping(msg: Ping, ctx: Context) -> None:
            handled.append(msg.n)

        # The sender's worker runs the forwarder; no listen_dsn: it polls.
        orders = pooler_bus("orders", pooled, concurrency=1, routes={"billing": remote_pooled})
        before = transactions(bouncer, database(remote))
        async with billing, orders:
            await asyncio.gather(*(orders.send(Ping(n=n), to="billing") for n in range(50)))
            await wait_until(lambda: sorted(handled) == list(range(50)), timeout=60)
        assert orders.forwarder is not None
        # Each moved once, and no transaction of the forwarder failed on the way.
        assert (orders.forwarder.stats.inserted, orders.forwarder.stats.failures) == (50, 0)
        assert transactions(bouncer, database(remote)) > before
