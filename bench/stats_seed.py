"""Fill queue tables with synthetic processed and failed rows, for figures and demos.

    python -m bench.stats_seed --dsn postgresql://postgres@127.0.0.1:5432/nmbus_bench \\
        --rows 1000000 --queues orders,billing,mail

Rows are generated inside PostgreSQL (``generate_series``), in batches, so a
million rows take seconds. Timings are random but shaped like a real bus:
sub-second queue latency with a long tail, retries that add seconds, a few
percent failures with a handful of distinct errors, and one incident in the
second queue (a latency spike, and three times the failure share while the
others get a quarter of it) so the report has something to show.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from datetime import UTC, datetime, timedelta

import asyncpg

from bench.sql import render
from nmbus.postgres import PostgresStore, install_schema

LABELS = ["orders.OrderPlaced", "billing.ChargeCard", "mail.SendReceipt", "stock.Reserve"]
ERRORS = [
    "ValueError: card number failed the Luhn check",
    "TimeoutError: payment gateway did not answer within 5s",
    "KeyError: 'customer_id'",
    "asyncpg.exceptions.UniqueViolationError: duplicate key value",
]


async def seed(
    dsn: str,
    rows: int,
    queues: list[str],
    schema: str = "nmbus",
    span_hours: float = 24.0,
    failure_share: float = 0.02,
    batch: int = 500_000,
    end: datetime | None = None,
) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await install_schema(conn, schema)
    finally:
        await conn.close()
    store = PostgresStore(dsn, schema=schema)
    await store.open()
    try:
        for q in queues:
            await store.ensure_queue(q)
    finally:
        await store.close()
    end = end or datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    start = end - timedelta(hours=span_hours)
    per_queue = [
        rows // len(queues) + (1 if i < rows % len(queues) else 0) for i in range(len(queues))
    ]
    conn = await asyncpg.connect(dsn)
    try:
        for i, (q, n) in enumerate(zip(queues, per_queue, strict=True)):
            sql = render("seed_rows", schema, q)
            prefix = f"seed-{q}-{int(time.time())}-"
            for lo in range(1, n + 1, batch):
                hi = min(n, lo + batch - 1)
                t0 = time.perf_counter()
                await conn.execute(
                    sql,
                    lo,
                    hi,
                    n,
                    start,
                    span_hours * 3600,
                    # the incident queue fails three times as often, the others rarely
                    failure_share * (3 if i == 1 else 0.25),
                    1 if i == 1 else 0,
                    q,
                    prefix,
                    ERRORS,
                    LABELS,
                )
                print(f"{q}: rows {lo}-{hi} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
            await conn.execute(render("seed_analyze", schema, q))
    finally:
        await conn.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.stats_seed", description=__doc__.split("\n")[0]
    )
    p.add_argument("--dsn", required=True)
    p.add_argument("--rows", type=int, default=100_000, help="rows in total, split over queues")
    p.add_argument("--queues", default="orders,billing,mail")
    p.add_argument("--schema", default="nmbus")
    p.add_argument("--span-hours", type=float, default=24.0, help="time the rows spread over")
    p.add_argument("--failure-share", type=float, default=0.02)
    args = p.parse_args(argv)
    asyncio.run(
        seed(
            args.dsn,
            args.rows,
            [q for q in args.queues.split(",") if q],
            args.schema,
            args.span_hours,
            args.failure_share,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
