"""The schema: created safely by many processes at once, versioned, indexed."""

from __future__ import annotations

import asyncio
import json

import asyncpg
import pytest

from nmbus.errors import SchemaVersionError
from nmbus.postgres import PostgresStore, install_schema
from nmbus.sql import render
from nmbus.store import SCHEMA_VERSION

COLUMNS = [
    "id", "from_endpoint", "to_endpoint", "subqueue", "insert_time", "last_processed",
    "retry_count", "retry_time", "error_info", "correlation_id", "label", "msg_text",
    "msg_headers", "unique_id", "handling_client_id", "lease_expires", "isolated",
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
    plan = await db.fetchval("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + claim, 100, "p", 30.0)
    text = json.dumps(json.loads(plan))
    assert '"Index Name": "busy_ready"' in text
    assert '"Node Type": "Seq Scan"' not in text


async def test_an_older_schema_is_migrated_queue_by_queue(dsn: str, db: asyncpg.Connection) -> None:
    store = PostgresStore(dsn)
    await store.open()
    try:
        await store.ensure_queue("billing")
        await store.ensure_queue("Odd.Name")
    finally:
        await store.close()
    # What a version-1 database looked like: queue tables 80 % full, no isolated column.
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
        "WHERE nspname = 'nmbus' AND relname IN ('billing', 'Odd.Name') ORDER BY relname"
    )
    assert [(r["relname"], "fillfactor=50" in r["reloptions"]) for r in options] == [
        ("Odd.Name", True),
        ("billing", True),
    ]
    isolated = await db.fetch(
        "SELECT table_name FROM information_schema.columns WHERE table_schema = 'nmbus' "
        "AND column_name = 'isolated' ORDER BY table_name"
    )
    assert [r["table_name"] for r in isolated] == ["Odd.Name", "billing"]
