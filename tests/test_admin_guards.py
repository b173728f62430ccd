"""The operations layer's guarantees on PostgreSQL: reads never write, nothing is created
where no schema is, and driver errors become nmbus errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

from nmbus.errors import DatabaseUnavailable, InvalidSetting, QueueNotFound, StoreError
from nmbus.ops.admin import Admin, RetentionPolicy
from nmbus.settings import Settings
from tests.ops_data import Facts


@pytest.fixture
async def admin(dsn: str) -> AsyncIterator[Admin]:
    async with Admin.from_settings(Settings(dsn=dsn)) as opened:
        yield opened


# -- reads never write; nothing is created where no schema is -----------------------------

Call = Callable[[Admin], Awaitable[Any]]
READS: list[Call] = [
    lambda a: a.schema_exists(),
    lambda a: a.list_queues(),
    lambda a: a.queue_status(),
    lambda a: a.failed_messages(),
    lambda a: a.failed_messages("billing", message_type="billing.Refund"),
    lambda a: a.message("billing", 1),
    lambda a: a.count_failed("billing"),
    lambda a: a.subscriptions(),
    lambda a: a.queue_status(exact=True),
    lambda a: a.queue_history("billing"),
    lambda a: a.queue_detail("billing"),
    lambda a: a.failed_page(error_contains="declined"),
    lambda a: a.retention_due(RetentionPolicy(max_age=timedelta(0), failed_max_age=timedelta(0))),
]
# These write, but only to a schema that is there: none of them may create one.
WRITES: list[Call] = [
    lambda a: a.requeue_failed("billing", every=True),
    lambda a: a.purge_failed("billing", every=True),
    lambda a: a.run_retention(RetentionPolicy(max_age=timedelta(0))),
    lambda a: a.drop_queues(["billing"]),
]


async def snapshot(db: asyncpg.Connection) -> list[Any]:
    """Every object of the database, and every row of nmbus's tables with its xmin."""
    objects = await db.fetch(
        "SELECT n.nspname, c.relname, c.relkind FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast') ORDER BY 1, 2"
    )
    functions = await db.fetch(
        "SELECT n.nspname, p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') ORDER BY 1, 2"
    )
    rows = []
    for schema, table, kind in objects:
        if kind == "r":
            rows.append(
                await db.fetch(f'SELECT xmin::text, * FROM "{schema}"."{table}" ORDER BY 2')
            )
    return [objects, functions, rows]


async def test_reads_write_nothing(dsn: str, db: asyncpg.Connection, facts: Facts) -> None:
    before = await snapshot(db)
    # Sessions of this database can only read: a read that tried to write would fail.
    name = await db.fetchval("SELECT current_database()")
    await db.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
    async with Admin(dsn) as admin:
        for read in READS:
            await read(admin)
        with pytest.raises(StoreError, match="read-only transaction"):
            await admin.requeue_failed("billing", every=True)  # the setting holds
    assert await snapshot(db) == before


@pytest.mark.parametrize("call", READS + WRITES)
async def test_a_missing_schema_is_reported_and_not_created(
    dsn: str, db: asyncpg.Connection, call: Call
) -> None:
    before = await snapshot(db)
    async with Admin(dsn, "nmbus_dmeo") as admin:
        if call is READS[0]:
            assert await call(admin) is False
        else:
            with pytest.raises(
                QueueNotFound, match="no nmbus schema 'nmbus_dmeo' in this database"
            ):
                await call(admin)
    assert await snapshot(db) == before


# -- errors ------------------------------------------------------------------------------


async def test_connection_errors_name_the_dsn_without_its_password() -> None:
    bad_port = "postgresql://postgres:s3cret@127.0.0.1:99999/x"
    async with Admin(bad_port) as admin:
        with pytest.raises(
            InvalidSetting, match=r"invalid DSN postgresql://postgres:\*\*\*@.*: Port out of range"
        ):
            await admin.list_queues()
    async with Admin("postgresql://postgres:s3cret@127.0.0.1:1/x") as admin:
        with pytest.raises(DatabaseUnavailable, match=r"cannot connect to .*:1/x") as raised:
            await admin.queue_status()
    assert "s3cret" not in str(raised.value) and "s3cret" not in repr(admin)


async def test_driver_errors_become_store_errors(admin: Admin, facts: Facts) -> None:
    with pytest.raises(StoreError, match="show a message of billing") as raised:
        await admin.message("billing", 2**70)  # out of bigint's range
    assert type(raised.value.__cause__).__module__.startswith("asyncpg")  # kept as the cause


async def test_the_pool_serves_concurrent_callers(dsn: str, facts: Facts) -> None:
    async with Admin(dsn, pool_size=3) as admin:
        got = await asyncio.gather(
            admin.queue_status(), admin.failed_messages(), admin.list_queues()
        )
    assert [len(g) for g in got] == [2, 3, 2]
