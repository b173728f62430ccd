"""Measure how long retention ever makes anyone wait for a queue table.

    python -m tests.retention_bench postgresql://postgres@127.0.0.1:5432/postgres \
        --rows 1000000 [--batch 5000] [--archive /tmp/nmbus-archive]

Creates its own database (dropped at the end), fills a queue with ``--rows``
old processed rows plus some ready ones, and runs retention while two probes
keep knocking on the table:

* the lock probe takes ``LOCK TABLE ... IN SHARE MODE`` over and over. SHARE
  conflicts with the ROW EXCLUSIVE lock every retention batch holds, so each
  of its waits is as long as the retention transaction it ran into: the
  longest wait is the longest time retention held the table against it;
* the claim probe runs the workers' claim statement (then rolls it back),
  with a short lock_timeout, and records how long each claim took.

Prints the figures; asserts nothing (tests/test_retention.py runs the same
probes on a smaller table and checks them).
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from nmbus.ports.operations import RetentionPolicy, RetentionResult
from nmbus.postgres import install_schema
from nmbus.postgres.floor import ReadyFloors
from nmbus.postgres.retention import clean_queue
from nmbus.postgres.segments import advance
from nmbus.postgres.sql import render
from tests.pg import with_database

QUEUE = "bench"


@dataclass
class Probe:
    waits: list[float] = field(default_factory=list)
    timeouts: int = 0
    seen_counts: list[int] = field(default_factory=list)

    @property
    def longest(self) -> float:
        return max(self.waits, default=0.0)


async def fill(conn: asyncpg.Connection, rows: int, ready: int = 1000) -> None:
    """``rows`` X rows processed 30 days ago and ``ready`` I rows, fast (server-side)."""
    await conn.execute(render("create_queue", "nmbus", QUEUE))
    await conn.execute(render("register_queue", "nmbus"), QUEUE)
    step = 200_000
    for start in range(0, rows, step):
        await conn.execute(
            f"""INSERT INTO nmbus."{QUEUE}" (from_endpoint, to_endpoint, subqueue, insert_time,
                   last_processed, retry_count, retry_time, label, msg_text, msg_headers, unique_id)
            SELECT 'orders', '{QUEUE}', 'X', t - interval '1 second', t, 1,
                   t - interval '5 milliseconds', 'bench.Ping', '{{"n": ' || g || '}}',
                   '{{"k": "v"}}'::jsonb, md5(g::text)
            FROM generate_series($1::bigint, $2::bigint) AS g,
                 LATERAL (SELECT now() - interval '30 days' + g * interval '1 millisecond') AS s(t)
            """,
            start,
            min(start + step, rows) - 1,
        )
    # The processed rows fill a segment of their own; new rows go to the next one.
    await advance(conn, "nmbus", QUEUE)
    await conn.execute(
        f"""INSERT INTO nmbus."{QUEUE}" (from_endpoint, to_endpoint, subqueue, label, msg_text,
               unique_id)
        SELECT 'orders', '{QUEUE}', 'I', 'bench.Ping', '{{}}', 'ready-' || g
        FROM generate_series(1, $1::int) AS g""",
        ready,
    )
    await conn.execute(f'VACUUM ANALYZE nmbus."{QUEUE}"')


async def lock_probe(dsn: str, stop: asyncio.Event, probe: Probe, timeout: float) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        while not stop.is_set():
            tx = conn.transaction()
            await tx.start()
            try:
                await conn.execute(f"SET LOCAL lock_timeout = '{int(timeout * 1000)}ms'")
                started = time.perf_counter()
                try:
                    await conn.execute(f'LOCK TABLE nmbus."{QUEUE}" IN SHARE MODE')
                except asyncpg.LockNotAvailableError:
                    probe.timeouts += 1
                    probe.waits.append(time.perf_counter() - started)
                    continue
                probe.waits.append(time.perf_counter() - started)
                probe.seen_counts.append(
                    await conn.fetchval(
                        f"SELECT count(*) FROM nmbus.\"{QUEUE}\" WHERE subqueue = 'X'"
                    )
                )
            finally:
                await tx.rollback()
            await asyncio.sleep(0.005)
    finally:
        await conn.close()


async def claim_probe(dsn: str, stop: asyncio.Event, probe: Probe, timeout: float) -> None:
    conn = await asyncpg.connect(dsn)
    sql = render("claim", "nmbus", QUEUE)
    floors = ReadyFloors("nmbus")  # read as a worker reads it
    try:
        while not stop.is_set():
            tx = conn.transaction()
            await tx.start()
            try:
                await conn.execute(f"SET LOCAL lock_timeout = '{int(timeout * 1000)}ms'")
                started = time.perf_counter()
                try:
                    await conn.fetch(sql, 10, "probe", 30.0, await floors.floor(conn, QUEUE))
                except asyncpg.LockNotAvailableError:
                    probe.timeouts += 1
                probe.waits.append(time.perf_counter() - started)
            finally:
                await tx.rollback()
            await asyncio.sleep(0.005)
    finally:
        await conn.close()


async def measure(
    dsn: str, policy: RetentionPolicy, lock_timeout: float = 5.0
) -> tuple[RetentionResult, Probe, Probe, float]:
    """Run retention on the bench queue with both probes going; returns their records."""
    stop = asyncio.Event()
    locks, claims = Probe(), Probe()
    probes = [
        asyncio.create_task(lock_probe(dsn, stop, locks, lock_timeout)),
        asyncio.create_task(claim_probe(dsn, stop, claims, lock_timeout)),
    ]
    await asyncio.sleep(0.2)
    conn = await asyncpg.connect(dsn)
    try:
        started = time.perf_counter()
        result = await clean_queue(conn, "nmbus", QUEUE, policy)
        elapsed = time.perf_counter() - started
    finally:
        await conn.close()
        await asyncio.sleep(0.1)
        stop.set()
        await asyncio.gather(*probes)
    return result, locks, claims, elapsed


async def main(args: Any) -> None:
    name = f"nmbus_bench_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(args.dsn)
    await admin.execute(f'CREATE DATABASE "{name}"')
    dsn = with_database(args.dsn, name)
    try:
        conn = await asyncpg.connect(dsn)
        try:
            await install_schema(conn, "nmbus")
            t = time.perf_counter()
            await fill(conn, args.rows)
            print(f"filled {args.rows} X rows in {time.perf_counter() - t:.1f}s")
        finally:
            await conn.close()
        policy = RetentionPolicy(
            batch_size=args.batch, archive_dir=Path(args.archive) if args.archive else None
        )
        result, locks, claims, elapsed = await measure(dsn, policy)
        print(f"retention: deleted {result.total} rows in {elapsed:.1f}s, "
              f"{result.batches} batches of <= {args.batch}, "
              f"longest batch {result.longest_batch_seconds * 1000:.0f} ms, "
              f"{len(result.files)} files")  # fmt: skip
        for label, probe in (("SHARE-lock probe", locks), ("claim probe", claims)):
            print(f"{label}: {len(probe.waits)} tries, longest wait "
                  f"{probe.longest * 1000:.0f} ms, timeouts {probe.timeouts}")  # fmt: skip
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dsn", help="a server DSN; a scratch database is created on it")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=5000)
    parser.add_argument("--archive", default=None, help="archive to this directory first")
    asyncio.run(main(parser.parse_args()))
