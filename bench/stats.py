"""Time the statistics job, and the same figures from one SQL query, on one database.

    python -m bench.stats --dsn postgresql://postgres@127.0.0.1:5432/nmbus_bench \\
        --master 'local[2]'

Prints one line per measurement: rows, seconds, rows per second. The SQL
query computes, per queue, type and hour, the counts, mean, percentile_cont
p50/p95/p99 and max of both latencies: what the job's ``windows`` table holds.
Seed a database first with ``python -m bench.stats_seed``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
import tempfile
import time
from typing import Any

import asyncpg

from nmbus.postgres import sql as core_sql
from nmbus.postgres.sql import quote_ident

SQL = """
SELECT queue, coalesce(label, '(none)') AS label,
       date_trunc('hour', coalesce(last_processed, retry_time, insert_time)) AS w,
       count(*) FILTER (WHERE subqueue = 'X') AS processed,
       count(*) FILTER (WHERE subqueue = 'F') AS failed,
       avg(q) AS q_mean, percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY q) AS q_p,
       max(q) AS q_max,
       avg(e) AS e_mean, percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY e) AS e_p,
       max(e) AS e_max
FROM (
    {union}
) AS r
GROUP BY 1, 2, 3
"""

PART = """SELECT {name} AS queue, subqueue, label, insert_time, last_processed, retry_time,
           CASE WHEN subqueue = 'X' THEN extract(epoch FROM last_processed - retry_time) END AS q,
           CASE WHEN subqueue = 'X' THEN extract(epoch FROM last_processed - insert_time) END AS e
    FROM {table} WHERE subqueue IN ('X', 'F')"""


def reference_sql(schema: str, queues: list[str]) -> str:
    """One SQL statement computing the job's per-window figures over ``queues``."""
    parts = [
        PART.format(
            name="'" + q.replace("'", "''") + "'",
            table=f"{quote_ident(schema)}.{quote_ident(q)}",
        )
        for q in queues
    ]
    return SQL.format(union="\n    UNION ALL\n    ".join(parts))


async def _queues(dsn: str, schema: str) -> list[str]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(core_sql.render("list_queues", schema), schema)
        return [r[0] for r in rows]
    finally:
        await conn.close()


async def time_sql(dsn: str, schema: str) -> tuple[int, int, float]:
    """(rows read, result rows, seconds) of the reference query."""
    queues = await _queues(dsn, schema)
    conn = await asyncpg.connect(dsn)
    try:
        count_sql = " + ".join(
            f"(SELECT count(*) FROM {quote_ident(schema)}.{quote_ident(q)} "
            "WHERE subqueue IN ('X', 'F'))"
            for q in queues
        )
        n = int(await conn.fetchval(f"SELECT {count_sql}"))
        started = time.perf_counter()
        result = await conn.fetch(reference_sql(schema, queues))
        return n, len(result), time.perf_counter() - started
    finally:
        await conn.close()


def time_job(
    dsn: str, schema: str, master: str, partitions: int, event_log: str | None = None
) -> tuple[int, float, float]:
    """(rows, seconds of the job, seconds including Spark start-up)."""
    # Imported by name, as `nmbus report` does: the job is plain PySpark code, not type-checked.
    job: Any = importlib.import_module("nmbus.stats.job")
    started = time.perf_counter()
    conf = {}
    if event_log:  # Spark's own record of every job, read by bench.stats_events
        os.makedirs(event_log, exist_ok=True)
        conf = {
            "spark.eventLog.enabled": "true",
            "spark.eventLog.dir": event_log,
            # One plain JSON file: what stats_events reads.
            "spark.eventLog.compress": "false",
            "spark.eventLog.rolling.enabled": "false",
        }
    from nmbus.demo.report import rows_estimate

    spark = job.build_session(master, extra_conf=conf, expected_rows=rows_estimate(dsn, schema))
    try:
        with tempfile.TemporaryDirectory(prefix="nmbus-bench-") as out:
            result = job.run(
                spark, job.Options(dsn=dsn, out=out, schema=schema, partitions=partitions)
            )
    finally:
        job.stop_session(spark)
    return result.rows, result.seconds, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stats", description=__doc__)
    p.add_argument("--dsn", required=True)
    p.add_argument("--schema", default="nmbus")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--partitions", type=int, default=8)
    p.add_argument("--skip-sql", action="store_true")
    p.add_argument("--skip-spark", action="store_true")
    p.add_argument("--event-log", help="write Spark's event log here and print where time went")
    p.add_argument("--repeat", type=int, default=1, help="run the job this many times")
    args = p.parse_args(argv)
    for _ in range(0 if args.skip_spark else args.repeat):
        rows, seconds, wall = time_job(
            args.dsn, args.schema, args.master, args.partitions, args.event_log
        )
        print(
            f"spark {args.master}: {rows:,} rows in {seconds:.1f}s "
            f"({rows / seconds:,.0f} rows/s; {wall:.1f}s with Spark start-up; "
            f"load {os.getloadavg()[0]:.1f})"
        )
        if args.event_log:
            from bench import stats_events

            stats_events.main([args.event_log])
    if not args.skip_sql:
        rows, groups, seconds = asyncio.run(time_sql(args.dsn, args.schema))
        print(
            f"single SQL query: {rows:,} rows in {seconds:.1f}s "
            f"({rows / seconds:,.0f} rows/s; {groups:,} result rows)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
