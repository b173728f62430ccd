"""Rows of a segmented test queue (``nmbus.billing``), for the tests of segments."""

from __future__ import annotations

import asyncpg

from nmbus.postgres import PostgresStore


async def make_queue(dsn: str, queue: str = "billing") -> None:
    store = PostgresStore(dsn)
    await store.open()
    try:
        await store.ensure_queue(queue)
    finally:
        await store.close()


async def add(
    db: asyncpg.Connection, n: int, subqueue: str = "X", ago: str = "2 days", prefix: str = "r"
) -> None:
    """``n`` rows of ``subqueue``, inserted and (for X/F) processed ``ago``."""
    await db.execute(
        """INSERT INTO nmbus.billing (from_endpoint, to_endpoint, subqueue, insert_time,
                   last_processed, retry_time, label, msg_text, unique_id, error_info)
            SELECT 'shop', 'billing', $1::text, now() - $2::text::interval - interval '1 second',
                   CASE WHEN $1::text IN ('X', 'F') THEN now() - $2::text::interval END,
                   now() - $2::text::interval - interval '1 second', 'test.Ping',
                   '{"n": ' || g || ', "pad": "' || repeat('x', 200) || '"}',
                   $3 || g, CASE WHEN $1::text = 'F' THEN 'ValueError: no' END
            FROM generate_series(1, $4::int) AS g""",
        subqueue,
        ago,
        f"{prefix}-{subqueue}-",
        n,
    )
