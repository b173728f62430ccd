"""The schema: created safely by many processes at once, versioned, indexed."""

from __future__ import annotations

import asyncio
import json
import re

import asyncpg
import pytest

from nmbus import Bus
from nmbus.errors import SchemaVersionError
from nmbus.ports.store import MAX_QUEUE_NAME, SCHEMA_VERSION
from nmbus.postgres import PostgresStore, install_schema
from nmbus.postgres.floor import NO_FLOOR, read_floor
from nmbus.postgres.schema import MIGRATIONS
from nmbus.postgres.sql import QUERIES, render
from tests.legacy import make_v9
from tests.messages import Ping

COLUMNS = [
    "id", "from_endpoint", "to_endpoint", "subqueue", "insert_time", "last_processed",
    "retry_count", "retry_time", "error_info", "correlation_id", "label", "msg_text",
    "msg_headers", "unique_id", "handling_client_id", "lease_expires", "isolated",
    "priority", "sequence_key", "expires_at",
]  # fmt: skip


async def test_many_processes_starting_at_once_create_everything_once(
    dsn: str, db: asyncpg.Connection
) -> None:
    stores = [PostgresStore(dsn, schema="fresh") for _ in range(6)]
    await asyncio.gather(*(s.open() for s in stores))
    try:
        await asyncio.gather(*(s.ensure_queue("billing") for s in stores))
    finally:
        await asyncio.gather(*(s.close() for s in stores))
    versions = await db.fetch("SELECT version FROM fresh.schema_version")
    assert [r["version"] for r in versions] == [SCHEMA_VERSION]
    assert [r["name"] for r in await db.fetch("SELECT name FROM fresh.queues")] == ["billing"]
    columns = await db.fetch(
        "SELECT column_name FROM information_schema.columns "
        "WHERE table_schema = 'fresh' AND table_name = 'billing' ORDER BY ordinal_position"
    )
    assert [r["column_name"] for r in columns] == COLUMNS


async def test_a_newer_schema_is_refused_not_guessed(db: asyncpg.Connection) -> None:
    await db.execute("INSERT INTO nmbus.schema_version (version) VALUES ($1)", SCHEMA_VERSION + 1)
    with pytest.raises(SchemaVersionError, match="newer than this nmbus"):
        await install_schema(db, "nmbus")


async def test_quoted_names_stay_names(dsn: str, db: asyncpg.Connection) -> None:
    store = PostgresStore(dsn)
    await store.open()
    try:
        for name in ("Mixed.Case-queue", "select", "_x"):
            await store.ensure_queue(name)
    finally:
        await store.close()
    tables = {
        r["tablename"]
        for r in await db.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'nmbus'")
    }
    assert {"Mixed.Case-queue", "select", "_x"} <= tables


async def test_the_claim_uses_the_partial_index_with_many_processed_rows(
    dsn: str, db: asyncpg.Connection
) -> None:
    store = PostgresStore(dsn)
    await store.open()
    try:
        await store.ensure_queue("busy")
    finally:
        await store.close()
    await db.execute(
        """INSERT INTO nmbus.busy (from_endpoint, to_endpoint, subqueue, retry_count,
                                   last_processed, label, msg_text, unique_id)
           SELECT 'x', 'busy', 'X', 1, now(), 'test.Ping', '{"n":1}', 'x' || g
           FROM generate_series(1, 200000) g"""
    )
    await db.execute(
        """INSERT INTO nmbus.busy (from_endpoint, to_endpoint, label, msg_text, unique_id)
           SELECT 'x', 'busy', 'test.Ping', '{"n":1}', 'i' || g FROM generate_series(1, 100) g"""
    )
    await db.execute("ANALYZE nmbus.busy")
    claim = render("claim", "nmbus", "busy")
    floor = await read_floor(db, "nmbus", "busy")
    plan = await db.fetchval(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + claim, 100, "p", 30.0, floor
    )
    text = json.dumps(json.loads(plan))
    # Each segment's part of the partitioned ready index.
    ready_parts = {
        r[0]
        for r in await db.fetch(
            """SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
               WHERE i.inhparent = 'nmbus."busy$ready"'::regclass"""
        )
    }
    used = set(re.findall(r'"Index Name": "([^"]+)"', text))
    assert used & ready_parts, used
    # No segment with rows is read whole (the empty next segment may be).
    scanned = re.findall(r'"Node Type": "Seq Scan"[^{}]*?"Relation Name": "([^"]+)"', text)
    assert "busy$s0" not in scanned, scanned


async def test_an_older_schema_is_migrated_queue_by_queue(dsn: str, db: asyncpg.Connection) -> None:
    store = PostgresStore(dsn)
    await store.open()
    try:
        await store.ensure_queue("billing")
        await store.ensure_queue("Odd.Name")
    finally:
        await store.close()
    # What a version-1 database looked like: plain queue tables 80 % full, no isolated column.
    await make_v9(db, "nmbus", ["billing", "Odd.Name"])
    await db.execute("DELETE FROM nmbus.schema_version")
    await db.execute("INSERT INTO nmbus.schema_version (version) VALUES (1)")
    for table in ('nmbus."billing"', 'nmbus."Odd.Name"'):
        await db.execute(f"ALTER TABLE {table} SET (fillfactor = 80)")
        await db.execute(f"ALTER TABLE {table} DROP COLUMN isolated")

    await install_schema(db, "nmbus")

    versions = await db.fetch("SELECT version FROM nmbus.schema_version ORDER BY version")
    assert [r["version"] for r in versions] == list(range(1, SCHEMA_VERSION + 1))
    options = await db.fetch(
        "SELECT relname, reloptions FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE nspname = 'nmbus' AND relname IN ('billing$s0', 'Odd.Name$s0') ORDER BY relname"
    )
    # The old tables are the queues' first segments now.
    assert [(r["relname"], "fillfactor=50" in r["reloptions"]) for r in options] == [
        ("Odd.Name$s0", True),
        ("billing$s0", True),
    ]
    isolated = await db.fetch(
        "SELECT table_name FROM information_schema.columns WHERE table_schema = 'nmbus' "
        "AND column_name = 'isolated' AND table_name IN ('billing', 'Odd.Name') "
        "ORDER BY table_name"
    )
    assert [r["table_name"] for r in isolated] == ["Odd.Name", "billing"]


async def test_a_plain_insert_needs_no_unique_id_and_duplicates_stay_refused(
    dsn: str, db: asyncpg.Connection
) -> None:
    async with Bus("sender", dsn=dsn, concurrency=0) as bus:
        await bus.send(Ping(n=1), to="billing", unique_id="given")
    plain = "INSERT INTO nmbus.billing (from_endpoint, to_endpoint, label, msg_text) "
    for n in (2, 3):
        await db.execute(plain + "VALUES ('psql', 'billing', 'test.Ping', $1)", f'{{"n":{n}}}')
    ids = [r[0] for r in await db.fetch("SELECT unique_id FROM nmbus.billing ORDER BY id")]
    assert ids[0] == "given" and len(set(ids)) == 3 and all(len(i) == 36 for i in ids[1:])
    # Refused the way nmbus's own inserts are: the row is skipped (the unique
    # table's trigger), whichever segment holds the first one.
    status = await db.execute(
        "INSERT INTO nmbus.billing (from_endpoint, to_endpoint, unique_id) "
        "VALUES ('psql', 'billing', 'given')"
    )
    assert status == "INSERT 0 0"
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing") == 3
    assert await db.fetchval('SELECT count(*) FROM nmbus."billing$unique"') == 3


# -- nmbus's own names never collide with a queue name (issue 11, defect 4) ---------------

COLLIDING = [
    ("orders_uid", "orders"),
    ("ship_ready", "ship"),
    ("pay_pkey", "pay"),
    ("pay_id_seq", "pay"),
    ("_orders", "orders"),
    ("queues_pkey",),
    ("subscriptions_pkey",),
    ("schema_version_pkey",),
]
ORDERS = [names for pair in COLLIDING for names in ([pair, pair[::-1]] if pair[1:] else [pair])]


async def own_objects(db: asyncpg.Connection, schema: str, table: str) -> dict[str, object]:
    """The indexes, primary key and identity sequence of one table, as the catalog has them."""
    rel = await db.fetchval(
        "SELECT format('%I.%I', $1::text, $2::text)::regclass::oid", schema, table
    )
    indexes = await db.fetch(
        "SELECT c.relname FROM pg_index x JOIN pg_class c ON c.oid = x.indexrelid "
        "WHERE x.indrelid = $1 ORDER BY 1",
        rel,
    )
    return {
        "indexes": [r[0] for r in indexes],
        "pkey": await db.fetchval(
            "SELECT conname FROM pg_constraint WHERE conrelid = $1 AND contype = 'p'", rel
        ),
        "sequence": await db.fetchval(
            "SELECT s.relname FROM pg_depend d JOIN pg_class s ON s.oid = d.objid "
            "WHERE d.refobjid = $1 AND d.deptype = 'i' AND s.relkind = 'S'",
            rel,
        ),
    }


def expected_objects(queue: str) -> dict[str, object]:
    return {
        "indexes": sorted(
            [f"{queue}$done", f"{queue}$group", f"{queue}$pkey", f"{queue}$ready", f"{queue}$seq"]
        ),
        "pkey": f"{queue}$pkey",
        "sequence": f"{queue}$id_seq",
    }


@pytest.mark.parametrize("names", ORDERS, ids="+".join)
async def test_queue_names_never_collide_with_nmbus_own_names(
    dsn: str, db: asyncpg.Connection, names: tuple[str, ...]
) -> None:
    async with Bus("sender", dsn=dsn, concurrency=0) as bus:
        for name in names:
            await bus.send(Ping(n=1), to=name, unique_id="once")
        for name in names:  # the unique index deduplicates in every table
            await bus.send(Ping(n=2), to=name, unique_id="once")
            await bus.send(Ping(n=3), to=name)
    for name in names:
        rows = await db.fetch(f'SELECT msg_text FROM nmbus."{name}" ORDER BY id')
        assert [json.loads(r[0])["n"] for r in rows] == [1, 3]
        assert await own_objects(db, "nmbus", name) == expected_objects(name)


async def test_shared_tables_have_names_no_queue_can_take(db: asyncpg.Connection) -> None:
    for table in ("schema_version", "queues", "subscriptions"):
        got = await own_objects(db, "nmbus", table)
        assert got == {"indexes": [f"{table}$pkey"], "pkey": f"{table}$pkey", "sequence": None}


async def test_the_longest_queue_name_keeps_every_suffix(dsn: str, db: asyncpg.Connection) -> None:
    # 48 characters plus "$id_seq" stay under PostgreSQL's 63-byte limit: nothing is truncated.
    long = "q" * MAX_QUEUE_NAME
    async with Bus("sender", dsn=dsn, concurrency=0) as bus:
        await bus.send(Ping(n=1), to=long)
    assert await own_objects(db, "nmbus", long) == expected_objects(long)


# What nmbus created up to schema version 2, frozen here: the migration must keep
# accepting it. nmbus's own names were "<table>_<role>", which a queue could take.
V2_SCHEMA = """
CREATE SCHEMA nmbus;
CREATE TABLE nmbus.schema_version (
    version integer PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE nmbus.queues (
    name text PRIMARY KEY,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE nmbus.subscriptions (
    publisher_endpoint text NOT NULL,
    subscriber_endpoint text NOT NULL,
    message_type text NOT NULL,
    created_date timestamptz NOT NULL DEFAULT now(),
    expiration_date timestamptz,
    PRIMARY KEY (publisher_endpoint, message_type, subscriber_endpoint)
);
INSERT INTO nmbus.schema_version (version) VALUES (2);
"""
V2_QUEUE = """
CREATE TABLE IF NOT EXISTS nmbus."{q}" (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    from_endpoint text NOT NULL,
    to_endpoint text NOT NULL,
    subqueue char(1) NOT NULL DEFAULT 'I' CHECK (subqueue IN ('I', 'R', 'X', 'F')),
    insert_time timestamptz NOT NULL DEFAULT now(),
    last_processed timestamptz,
    retry_count integer NOT NULL DEFAULT 0,
    retry_time timestamptz NOT NULL DEFAULT now(),
    error_info text,
    correlation_id text,
    label text,
    msg_text text,
    msg_headers jsonb,
    unique_id text NOT NULL,
    handling_client_id text,
    lease_expires timestamptz
) WITH (fillfactor = 50);
CREATE INDEX IF NOT EXISTS "{q}_ready" ON nmbus."{q}" (retry_time, id)
    WHERE subqueue IN ('I', 'R');
CREATE UNIQUE INDEX IF NOT EXISTS "{q}_uid" ON nmbus."{q}" (unique_id);
INSERT INTO nmbus.queues (name) VALUES ('{q}') ON CONFLICT DO NOTHING;
"""
# In this order, version 2 left "orders" without its unique index (every send to it
# failed) and "ship" without its ready index.
V2_QUEUES = ["billing", "Odd.Name", "orders_uid", "orders", "ship_ready", "ship"]


async def test_a_version_2_schema_is_migrated_to_names_no_queue_can_take(
    dsn: str, db: asyncpg.Connection
) -> None:
    await db.execute("DROP SCHEMA nmbus CASCADE")
    await db.execute(V2_SCHEMA)
    for queue in V2_QUEUES:
        await db.execute(V2_QUEUE.format(q=queue))
    assert "orders_uid" not in (await own_objects(db, "nmbus", "orders"))["indexes"]
    assert "ship_ready" not in (await own_objects(db, "nmbus", "ship"))["indexes"]
    await db.execute(
        """INSERT INTO nmbus.billing (from_endpoint, to_endpoint, subqueue, last_processed,
                                      label, msg_text, unique_id)
           SELECT 'x', 'billing', 'X', now(), 'test.Ping', '{"n":0}', 'x' || g
           FROM generate_series(1, 50000) g"""
    )
    await db.execute(
        """INSERT INTO nmbus.billing (from_endpoint, to_endpoint, label, msg_text, unique_id)
           SELECT 'x', 'billing', 'test.Ping', '{"n":0}', 'i' || g FROM generate_series(1, 100) g"""
    )

    await install_schema(db, "nmbus")

    versions = await db.fetch("SELECT version FROM nmbus.schema_version ORDER BY version")
    assert [r["version"] for r in versions] == list(range(2, SCHEMA_VERSION + 1))
    for queue in V2_QUEUES:
        assert await own_objects(db, "nmbus", queue) == expected_objects(queue)
    for table in ("schema_version", "queues", "subscriptions"):
        assert (await own_objects(db, "nmbus", table))["pkey"] == f"{table}$pkey"
    await install_schema(db, "nmbus")  # a second start changes nothing
    assert await db.fetchval("SELECT count(*) FROM nmbus.schema_version") == SCHEMA_VERSION - 1

    # The indexes are used: the claim walks the ready index; inserts dedup on the unique table.
    await db.execute("ANALYZE nmbus.billing")
    plan = await db.fetchval(
        "EXPLAIN (FORMAT JSON) " + render("claim", "nmbus", "billing"), 100, "p", 30.0, NO_FLOOR
    )
    # The old table is segment 0, its ready index the first part of the queue's.
    assert '"Index Name": "billing$s0$ready"' in json.dumps(json.loads(plan))

    # Every queue takes messages again, the identity goes on after the old rows, and a
    # re-sent unique_id is stored once.
    async with Bus("sender", dsn=dsn, concurrency=0) as bus:
        for queue in V2_QUEUES:
            await bus.send(Ping(n=1), to=queue, unique_id="i1")
            await bus.send(Ping(n=2), to=queue, unique_id="i1")
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing") == 50100
    # unique_id has a default now, so an operator's plain INSERT works in every old table.
    for queue in V2_QUEUES:
        await db.execute(
            f'INSERT INTO nmbus."{queue}" (from_endpoint, to_endpoint) VALUES ($1, $1)', queue
        )
    for queue in V2_QUEUES[1:]:
        rows = await db.fetch(f'SELECT msg_text FROM nmbus."{queue}" ORDER BY id')
        assert [r[0] and json.loads(r[0]) for r in rows] == [{"n": 1}, None]


async def test_a_version_4_queue_gets_priority_sequence_and_expiry_without_a_rewrite(
    dsn: str, db: asyncpg.Connection
) -> None:
    store = PostgresStore(dsn)
    await store.open()
    try:
        await store.ensure_queue("billing")
    finally:
        await store.close()
    # What version 4 had: no delivery columns, the ready index on (retry_time, id).
    await db.execute(
        """DROP INDEX nmbus."billing$ready"; DROP INDEX nmbus."billing$seq";
           DROP INDEX nmbus."billing$done";
           ALTER TABLE nmbus.billing DROP COLUMN priority, DROP COLUMN sequence_key,
                                     DROP COLUMN expires_at;
           CREATE INDEX "billing$ready" ON nmbus.billing (retry_time, id)
               WHERE subqueue IN ('I', 'R');
           DELETE FROM nmbus.schema_version;
           INSERT INTO nmbus.schema_version (version) VALUES (4)"""
    )
    await db.execute(
        """INSERT INTO nmbus.billing (from_endpoint, to_endpoint, label, msg_text, unique_id)
           SELECT 'x', 'billing', 'test.Ping', '{"n":0}', 'i' || g FROM generate_series(1, 10) g"""
    )
    before = await db.fetchval("SELECT pg_relation_filenode('nmbus.billing')")

    await install_schema(db, "nmbus")

    assert await db.fetchval("SELECT max(version) FROM nmbus.schema_version") == SCHEMA_VERSION
    # ADD COLUMN with a constant default is catalog-only: the table was not rewritten.
    assert await db.fetchval("SELECT pg_relation_filenode('nmbus.billing')") == before
    assert (
        await db.fetchval(
            "SELECT count(*) FROM nmbus.billing WHERE priority = 0 AND sequence_key IS NULL "
            "AND expires_at IS NULL"
        )
        == 10
    )
    ready = await db.fetchval("SELECT pg_get_indexdef('nmbus.\"billing$ready\"'::regclass)")
    assert "(priority DESC, retry_time, id)" in ready
    assert "WHERE ((subqueue = ANY" in ready and "(retry_time < 'infinity'" in ready
    assert await own_objects(db, "nmbus", "billing") == expected_objects("billing")


async def test_a_version_5_queue_gets_the_done_index(dsn: str, db: asyncpg.Connection) -> None:
    store = PostgresStore(dsn)
    await store.open()
    try:
        await store.ensure_queue("billing")
    finally:
        await store.close()
    await db.execute(
        """DROP INDEX nmbus."billing$done";
           DELETE FROM nmbus.schema_version;
           INSERT INTO nmbus.schema_version (version) VALUES (6)"""
    )
    await install_schema(db, "nmbus")
    assert await db.fetchval("SELECT max(version) FROM nmbus.schema_version") == SCHEMA_VERSION
    done = await db.fetchval("SELECT pg_get_indexdef('nmbus.\"billing$done\"'::regclass)")
    assert "(subqueue, last_processed, id)" in done and "WHERE (subqueue = ANY" in done
    assert await own_objects(db, "nmbus", "billing") == expected_objects("billing")


async def test_a_version_7_schema_gets_the_periodic_due_record(
    dsn: str, db: asyncpg.Connection
) -> None:
    store = PostgresStore(dsn)
    await store.open()
    await store.close()
    await db.execute(
        """DROP TABLE nmbus."periodic$due";
           DELETE FROM nmbus.schema_version;
           INSERT INTO nmbus.schema_version (version) VALUES (7)"""
    )
    await install_schema(db, "nmbus")
    assert await db.fetchval("SELECT max(version) FROM nmbus.schema_version") == SCHEMA_VERSION
    got = await own_objects(db, "nmbus", "periodic$due")
    assert got == {"indexes": ["periodic$due$pkey"], "pkey": "periodic$due$pkey", "sequence": None}
    assert await db.fetchval('SELECT count(*) FROM nmbus."periodic$due"') == 0


def test_the_schema_version_is_the_last_migration() -> None:
    # Renumbering a migration means changing its key and SCHEMA_VERSION together.
    assert max(MIGRATIONS) == SCHEMA_VERSION
    assert all(name in QUERIES for names in MIGRATIONS.values() for name in names)
