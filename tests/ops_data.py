"""A populated queue database whose every figure is known, for the operations tests."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from nmbus.postgres.segments import advance
from nmbus.postgres.sql import SEGMENT_SPAN, render
from nmbus.rows import COLUMNS as ROW_COLUMNS

COLUMNS = (
    "from_endpoint, to_endpoint, subqueue, insert_time, last_processed, retry_count, "
    "retry_time, error_info, label, msg_text, msg_headers, unique_id, handling_client_id, "
    "lease_expires"
)


async def create_queue(db: asyncpg.Connection, queue: str, schema: str = "nmbus") -> None:
    await db.execute(render("create_queue", schema, queue))
    await db.execute(render("register_queue", schema), queue)


def row(
    subqueue: str,
    *,
    last_processed: datetime | None = None,
    retry_time: datetime,
    insert_time: datetime | None = None,
    retry_count: int = 1,
    error_info: str | None = None,
    label: str = "billing.Charge",
    held_by: str | None = None,
    lease_expires: datetime | None = None,
    queue: str = "billing",
) -> tuple[Any, ...]:
    return (
        "orders",
        queue,
        subqueue,
        insert_time or retry_time,
        last_processed,
        retry_count,
        retry_time,
        error_info,
        label,
        json.dumps({"order_id": 1}),
        json.dumps({"tenant": "acme"}),
        uuid.uuid4().hex,
        held_by,
        lease_expires,
    )


async def count(db: asyncpg.Connection, where: str, queue: str = "billing") -> int:
    return int(await db.fetchval(f'SELECT count(*) FROM nmbus."{queue}" WHERE {where}'))


@asynccontextmanager
async def notifications(dsn: str) -> AsyncIterator[asyncio.Queue[str]]:
    """The payloads of the wake-ups sent to the workers of schema nmbus while the block runs."""
    listener = await asyncpg.connect(dsn)
    notes: asyncio.Queue[str] = asyncio.Queue()
    await listener.add_listener("nmbus_nmbus", lambda *a: notes.put_nowait(a[3]))
    try:
        yield notes
    finally:
        await listener.close()


async def insert(db: asyncpg.Connection, queue: str, rows: list[tuple[Any, ...]]) -> None:
    values = ", ".join(f"${i}::jsonb" if i == 11 else f"${i}" for i in range(1, 15))
    await db.executemany(f'INSERT INTO nmbus."{queue}" ({COLUMNS}) VALUES ({values})', rows)


@dataclass
class Facts:
    now: datetime
    processed_at: list[datetime] = field(default_factory=list)
    failed_ids: list[int] = field(default_factory=list)


CHARGE_ERROR = "ValueError: card declined\nTraceback (most recent call last):\n  File ..."
REFUND_ERROR = "KeyError: 'refund_id'\nTraceback (most recent call last):\n  File ..."


async def populate(db: asyncpg.Connection) -> Facts:
    """Queue billing with rows in every state, queue shipping with one, subscriptions.

    billing: 100 X processed 2 minutes ago with latencies 1..100 ms; 10/20/30 X
    processed 1/2/3 days ago (latency 1 s); 5 X 30 days ago; 3 F (2 Charge, 1
    Refund); I: 4 free (oldest ready 30 minutes), 1 held by a live lease (ready
    20 minutes), 1 whose lease lapsed (ready 10 minutes); R: 2 due in an hour, 1
    due 5 minutes ago.
    """
    now: datetime = await db.fetchval("SELECT now()")
    facts = Facts(now)
    await create_queue(db, "billing")
    await create_queue(db, "shipping")
    m = timedelta(minutes=1)
    rows: list[tuple[Any, ...]] = []
    for k in range(1, 101):
        done = now - 2 * m
        rows.append(row("X", last_processed=done, retry_time=done - timedelta(milliseconds=k)))
        facts.processed_at.append(done)
    for days in (1, 2, 3, 30):
        for _ in range(5 if days == 30 else days * 10):
            done = now - timedelta(days=days)
            rows.append(row("X", last_processed=done, retry_time=done - timedelta(seconds=1)))
            facts.processed_at.append(done)
    failed = [
        row(
            "F",
            last_processed=now - 50 * m,
            retry_time=now - 55 * m,
            retry_count=5,
            error_info=CHARGE_ERROR,
        ),
        row(
            "F",
            last_processed=now - 40 * m,
            retry_time=now - 45 * m,
            retry_count=5,
            error_info=REFUND_ERROR,
            label="billing.Refund",
        ),
        row(
            "F",
            last_processed=now - 30 * m,
            retry_time=now - 35 * m,
            retry_count=5,
            error_info=CHARGE_ERROR,
        ),
    ]
    rows.extend(failed)
    for minutes in (30, 3, 2, 1):
        rows.append(row("I", retry_time=now - minutes * m, retry_count=0))
    rows.append(row("I", retry_time=now - 20 * m, held_by="host:1:live", lease_expires=now + 5 * m))
    rows.append(row("I", retry_time=now - 10 * m, held_by="host:2:dead", lease_expires=now - m))
    rows.append(row("R", retry_time=now + 60 * m, retry_count=2))
    rows.append(row("R", retry_time=now + 60 * m, retry_count=2))
    rows.append(row("R", retry_time=now - 5 * m, retry_count=1))
    await insert(db, "billing", rows)
    await insert(db, "shipping", [row("I", retry_time=now, queue="shipping", retry_count=0)])
    facts.failed_ids = [
        r[0] for r in await db.fetch("SELECT id FROM nmbus.billing WHERE subqueue='F' ORDER BY id")
    ]
    await db.executemany(
        "INSERT INTO nmbus.subscriptions VALUES ($1, $2, $3, $4, $5)",
        [
            ("orders", "billing", "orders.OrderPlaced", now - 60 * m, None),
            ("orders", "shipping", "orders.OrderPlaced", now - 60 * m, now + 60 * m),
            ("orders", "audit", "orders.OrderPlaced", now - 60 * m, now - m),
            ("orders", "billing", "orders.OrderCancelled", now - 60 * m, None),
            ("payments", "billing", "payments.Refunded", now - 60 * m, None),
        ],
    )
    return facts


async def split_segments(
    db: asyncpg.Connection, where: str, queue: str = "billing", schema: str = "nmbus"
) -> None:
    """Keep the rows matching ``where`` in their segment and move every other row
    to the next one (its id plus the segment span, so the order holds); new rows
    then go to the segment after that. For retention tests: an old segment that
    holds exactly the rows ``where`` picks.
    """
    q = f'"{schema}"."{queue}"'
    unique = f'"{schema}"."{queue}$unique"'
    rest = f"({where}) IS NOT TRUE"
    others = ", ".join(c for c in ROW_COLUMNS if c != "id")
    await advance(db, schema, queue)
    async with db.transaction():
        await db.execute(
            f"DELETE FROM {unique} WHERE unique_id IN (SELECT unique_id FROM {q} WHERE {rest})"
        )
        await db.execute(
            f"WITH gone AS (DELETE FROM {q} WHERE {rest} RETURNING *) "
            f"INSERT INTO {q} (id, {others}) OVERRIDING SYSTEM VALUE "
            f"SELECT id + {SEGMENT_SPAN}, {others} FROM gone"
        )
    await advance(db, schema, queue)
