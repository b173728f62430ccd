"""``python -m bench retention``: removing processed rows row by row against dropping segments.

Both runs load the same queue: ``x_rows`` X rows processed 30 days ago, spread
over ``segments`` segments, and 1,000 ready rows in the segment being written.
Then, while a probe runs a worker's claim every 10 ms on its own connection
(rolled back each time) and records the longest it took:

* ``delete``: the batched DELETE retention ran before segments (5,000 rows a
  transaction, walking the ids), and the VACUUM that has to follow it;
* ``segments``: one retention run, which drops the old segments whole.

Each reports wall time, WAL written, dead tuples left, the queue's size on
disk before and after (its segments and its unique table) and the probe's
worst wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import asyncpg

from bench.sql import render
from nmbus.bench.scratch import QUEUE, BenchOptions, Scratch, load_segments
from nmbus.ports.operations import RetentionPolicy, RetentionResult
from nmbus.postgres import sql as core_sql
from nmbus.postgres.floor import ReadyFloors
from nmbus.postgres.retention import _walk, clean_queue
from nmbus.postgres.sql import own_name, quote_ident

ScratchRun = Callable[[Callable[[Scratch], Awaitable[Any]]], Awaitable[Any]]
MiB = 1024 * 1024


async def _probe(dsn: str, schema: str, stop: asyncio.Event, waits: list[float]) -> None:
    conn = await asyncpg.connect(dsn)
    claim = core_sql.render("claim", schema, QUEUE)
    floors = ReadyFloors(schema)  # read as a worker reads it
    try:
        while not stop.is_set():
            started = time.perf_counter()
            tx = conn.transaction()
            await tx.start()
            try:
                floor = await floors.floor(conn, QUEUE)
                await conn.fetch(claim, 1, "bench-probe", 30.0, floor)
            finally:
                await tx.rollback()
            waits.append(time.perf_counter() - started)
            await asyncio.sleep(0.01)
    finally:
        await conn.close()


async def _state(scratch: Scratch) -> dict[str, float]:
    with contextlib.suppress(asyncpg.UndefinedFunctionError):
        await scratch.c.execute("SELECT pg_stat_force_next_flush()")
    schema = quote_ident(scratch.schema)
    row = await scratch.c.fetchrow(
        render("bench_retention_state", scratch.schema, QUEUE),
        f"{schema}.{quote_ident(QUEUE)}",
        f"{schema}.{quote_ident(own_name(QUEUE, 'unique'))}",
    )
    assert row is not None
    return {"bytes": float(row["bytes"]), "dead": float(row["dead"]), "lsn": float(row["lsn"])}


async def measure_retention(
    options: BenchOptions, scratch_run: ScratchRun, progress: Callable[[str], None]
) -> dict[str, float]:
    figures: dict[str, float] = {}
    policy = RetentionPolicy(max_age=timedelta(days=1), batch_size=5000)
    for method in ("delete", "segments"):

        async def body(scratch: Scratch, method: str = method) -> None:
            await scratch.create_queue()
            progress(f"retention ({method}): loading {options.x_rows} X rows")
            await load_segments(scratch, options.x_rows, options.segments, timedelta(days=30))
            await scratch.preload(1000)
            await scratch.c.execute(render("bench_vacuum", scratch.schema, QUEUE))
            await scratch.checkpoint()
            before = await _state(scratch)
            stop, waits = asyncio.Event(), list[float]()
            probe = asyncio.create_task(_probe(options.dsn, scratch.schema, stop, waits))
            await asyncio.sleep(0.2)
            try:
                progress(f"retention ({method}): removing")
                started = time.perf_counter()
                result = RetentionResult(QUEUE)
                if method == "delete":
                    await _walk(
                        scratch.c, scratch.schema, QUEUE, "X", policy.max_age, policy, result, None
                    )
                    removed = time.perf_counter() - started
                    left = await _state(scratch)
                    figures["delete_dead_tuples_left"] = left["dead"]
                    vacuum = time.perf_counter()
                    await scratch.c.execute(render("bench_vacuum_only", scratch.schema, QUEUE))
                    figures["delete_vacuum_seconds"] = time.perf_counter() - vacuum
                else:
                    result = await clean_queue(scratch.c, scratch.schema, QUEUE, policy)
                    removed = time.perf_counter() - started
            finally:
                stop.set()
                await probe
            after = await _state(scratch)
            if result.deleted["X"] != options.x_rows:
                raise RuntimeError(f"{method} removed {result.deleted['X']} of {options.x_rows}")
            figures[f"{method}_seconds"] = removed
            figures[f"{method}_wal_mb"] = (after["lsn"] - before["lsn"]) / MiB
            figures[f"{method}_dead_tuples_after"] = after["dead"]
            figures[f"{method}_size_before_mb"] = before["bytes"] / MiB
            figures[f"{method}_size_after_mb"] = after["bytes"] / MiB
            figures[f"{method}_worst_claim_ms"] = max(waits) * 1000 if waits else 0.0
            figures[f"{method}_probe_claims"] = float(len(waits))

        await scratch_run(body)
    return figures
