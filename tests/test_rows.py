"""The row written down once (nmbus/rows.py) against a real queue table's catalogue.

Every copy of the row's shape is derived from nmbus.rows by name; these tests
hold that list to the table PostgreSQL made from the create_queue block, and
every statement that returns whole rows or claimed messages to it.
"""

from __future__ import annotations

from dataclasses import fields

import asyncpg

from nmbus.messages import StoredMessage
from nmbus.ports.operations import MessageRow
from nmbus.postgres.retention import ARCHIVE_COLUMNS, archive_schema
from nmbus.postgres.rows import CLAIMED, SENT
from nmbus.postgres.sql import render
from nmbus.rows import COLUMNS, QueueRow

# How each PostgreSQL type of a queue table's column is held in Python.
PYTHON = {
    "bigint": "int",
    "integer": "int",
    "smallint": "int",
    "boolean": "bool",
    "text": "str",
    "character(1)": "str",
    "jsonb": "str",  # as JSON text
    "timestamp with time zone": "datetime",
}


async def catalogue(db: asyncpg.Connection, table: str) -> list[asyncpg.Record]:
    return await db.fetch(
        "SELECT a.attname AS name, format_type(a.atttypid, a.atttypmod) AS type, "
        "a.attnotnull AS not_null FROM pg_attribute AS a "
        "WHERE a.attrelid = $1::regclass AND a.attnum > 0 AND NOT a.attisdropped "
        "ORDER BY a.attnum",
        table,
    )


async def columns_of(
    db: asyncpg.Connection, block: str, queue: str | None = "q"
) -> tuple[str, ...]:
    statement = await db.prepare(render(block, "nmbus", queue))
    return tuple(a.name for a in statement.get_attributes())


async def test_the_column_list_is_the_queue_table(db: asyncpg.Connection) -> None:
    await db.execute(render("create_queue", "nmbus", "q"))
    table = await catalogue(db, "nmbus.q")
    assert tuple(c["name"] for c in table) == COLUMNS
    for column, field in zip(table, fields(QueueRow), strict=True):
        held = PYTHON[column["type"]]
        expected = held if column["not_null"] else f"{held} | None"
        assert field.type == expected, column["name"]


async def test_the_operators_row_and_the_archive_hold_every_column(
    db: asyncpg.Connection,
) -> None:
    await db.execute(render("create_queue", "nmbus", "q"))
    names = tuple(c["name"] for c in await catalogue(db, "nmbus.q"))
    assert tuple(f.name for f in fields(MessageRow))[: len(names)] == names
    assert tuple(f.name for f in fields(MessageRow))[len(names) :] == (
        "error_info_chars",
        "msg_text_chars",
        "msg_headers_chars",
    )
    assert names == ARCHIVE_COLUMNS
    assert tuple(archive_schema().names) == names
    # The statements that read whole rows return them under the same names.
    assert await columns_of(db, "ops_message") == tuple(f.name for f in fields(MessageRow))
    assert await columns_of(db, "retention_pick") == names


async def test_every_claim_returns_a_stored_message_by_name(db: asyncpg.Connection) -> None:
    await db.execute(render("create_queue", "nmbus", "q"))
    assert tuple(f.name for f in fields(StoredMessage)) == CLAIMED
    computed = {"recovered", "expired"}  # what the claim works out; the rest are columns
    # The claim a row is leased under is its handling_client_id, by another name.
    assert "handling_client_id" in COLUMNS
    assert set(CLAIMED) - computed - {"claim"} <= set(COLUMNS)
    assert await columns_of(db, "claim") == CLAIMED
    for block in ("finish_claim", "finish_claim_processed"):
        assert await columns_of(db, block) == (*CLAIMED, "finished"), block


async def test_what_a_sender_gives_is_the_outboxs_columns(db: asyncpg.Connection) -> None:
    outbox = {c["name"] for c in await catalogue(db, "nmbus.outbox")}
    assert set(SENT) <= outbox
    assert set(SENT) - {"deliver_at"} <= set(COLUMNS)
    assert set(await columns_of(db, "outbox_take", queue=None)) >= set(SENT)
