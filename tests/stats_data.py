"""Queue rows for the statistics job's tests: many queues of known shape, and one doomed."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg

from nmbus.postgres import PostgresStore

T0 = datetime(2024, 3, 1, 9, 40, tzinfo=UTC)
ERRORS = ["ValueError: boom", "KeyError: 'customer_id'", "TimeoutError: gateway"]
LABELS = ["orders.OrderPlaced", "billing.ChargeCard", "mail.SendReceipt"]

# $1 queue name, $2 start time, $3 error lines, $4 labels, $5 rows.
SEED = """
INSERT INTO {q} (from_endpoint, to_endpoint, subqueue, insert_time, last_processed,
                 retry_count, retry_time, error_info, label, unique_id)
SELECT 'test', $1,
       CASE WHEN g % 10 = 0 THEN 'F' WHEN g % 97 = 0 THEN 'I' WHEN g % 89 = 0 THEN 'R'
            ELSE 'X' END,
       ins,
       CASE WHEN g % 211 = 0 THEN NULL
            ELSE ready + ((g * 37) % 1000 + 1) * interval '1 millisecond'
                 + (g % 13) * interval '1 microsecond'
                 + CASE WHEN g % 50 = 7 THEN interval '5 seconds' ELSE interval '0' END
       END,
       1 + g % 4, ready,
       CASE WHEN g % 10 = 0 AND g % 30 <> 20
                 THEN ($3::text[])[1 + (g / 10) % 3] || E'  \\nTraceback:\\n  line 1'
            WHEN g % 4 > 0 AND g % 3 = 0 THEN E'TimeoutError: slow\\r\\n  File x'
            WHEN g % 4 > 0 AND g % 7 = 0
                 THEN 'LookupError: order ' || g || ' not found (ref 0x' || to_hex(g * 7919)
                      || ', trace ' || md5(g::text)::uuid || ')'
            WHEN g % 4 > 0 AND g % 11 = 0 THEN 'RetryLater: greylisted for ' || g % 5 || 's'
       END,
       CASE WHEN g % 53 = 0 THEN NULL ELSE ($4::text[])[1 + g % 3] END,
       $1 || '-' || g
FROM (
    SELECT g, $2::timestamptz + g * interval '1.7 seconds' AS ins,
           $2::timestamptz + g * interval '1.7 seconds' + (g % 7) * interval '250 ms' AS ready
    FROM generate_series(1, $5::int) AS g
) AS s
"""


async def seed(dsn: str, sizes: dict[str, int], start: datetime = T0) -> None:
    store = PostgresStore(dsn)
    await store.open()
    try:
        for q in sizes:
            await store.ensure_queue(q)
    finally:
        await store.close()
    conn = await asyncpg.connect(dsn)
    try:
        for i, (q, n) in enumerate(sizes.items()):
            if n:
                await conn.execute(
                    SEED.format(q=f'nmbus."{q}"'),
                    q,
                    start + timedelta(minutes=13 * i),
                    ERRORS,
                    LABELS,
                    n,
                )
    finally:
        await conn.close()


async def seed_doomed(dsn: str) -> None:
    """A queue where everything failed; one row has no error text, one no timestamps left."""
    store = PostgresStore(dsn)
    await store.open()
    try:
        await store.ensure_queue("doomed")
    finally:
        await store.close()
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            """
            INSERT INTO nmbus.doomed (from_endpoint, to_endpoint, subqueue, insert_time,
                last_processed, retry_count, retry_time, error_info, label, unique_id)
            SELECT 'test', 'doomed', 'F', $1::timestamptz + g * interval '1 minute',
                   CASE WHEN g = 2 THEN NULL
                        ELSE $1::timestamptz + g * interval '1 minute' + interval '3 s' END,
                   5, $1::timestamptz + g * interval '1 minute',
                   CASE WHEN g = 3 THEN NULL ELSE 'RuntimeError: poison' || E'\\nTraceback' END,
                   'poison.Pill', 'doomed-' || g
            FROM generate_series(1, 6) AS g
            """,
            T0,
        )
    finally:
        await conn.close()
