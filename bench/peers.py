"""``python -m bench peers``: pgqueuer on the same server, in the same sitting.

pgqueuer is an optional extra (``pip install 'nmbus[peers]'``). Its tables go
in the bench's scratch schema (pgqueuer follows the connection's
``search_path``), so nothing of the database pointed at is touched. It drains
``messages`` jobs with a no-op entrypoint, in drain mode, at batch sizes 10 and
100, timed from the first job's start to the end of the drain (its status log
flushed); the nmbus drain of the same run is the figure it is compared with.
"""

from __future__ import annotations

import time
from typing import Any

import asyncpg

from bench.sql import render
from nmbus.bench.scratch import BenchOptions, Scratch

BATCHES = (10, 100)
_ENQUEUE_CHUNK = 1000


def available() -> bool:
    """Whether pgqueuer can be imported here."""
    try:
        import pgqueuer  # noqa: F401
    except ImportError:
        return False
    return True


def version() -> str:
    from importlib.metadata import version as dist_version

    return dist_version("pgqueuer")


async def measure_pgqueuer(options: BenchOptions, scratch: Scratch, batch_size: int) -> float:
    """Jobs per second of one pgqueuer QueueManager draining ``messages`` no-op jobs."""
    from datetime import timedelta

    from pgqueuer.adapters.drivers.asyncpg import AsyncpgDriver
    from pgqueuer.core.qm import QueueManager
    from pgqueuer.domain.types import QueueExecutionMode
    from pgqueuer.queries import Queries

    total = options.messages
    settings = {"search_path": scratch.schema}
    setup = await asyncpg.connect(options.dsn, server_settings=settings)
    try:
        queries = Queries(AsyncpgDriver(setup))
        await queries.install(create_schema=False)
        for first in range(0, total, _ENQUEUE_CHUNK):
            n = min(_ENQUEUE_CHUNK, total - first)
            await queries.enqueue(["bench"] * n, [None] * n, [0] * n)
    finally:
        await setup.close()
    await scratch.checkpoint()

    conn = await asyncpg.connect(options.dsn, server_settings=settings)
    try:
        manager = QueueManager(Queries(AsyncpgDriver(conn)))
        seen: list[float] = []

        @manager.entrypoint("bench")
        async def noop(job: Any) -> None:
            if not seen:
                seen.append(time.perf_counter())
            seen.append(0.0)

        await manager.run(
            dequeue_timeout=timedelta(seconds=1),
            batch_size=batch_size,
            mode=QueueExecutionMode.drain,
            log_aggregation_interval=timedelta(0),
        )
        elapsed = time.perf_counter() - seen[0]
    finally:
        await conn.close()
    handled = len(seen) - 1
    left = int(await scratch.c.fetchval(render("bench_pgqueuer_left", scratch.schema)))
    if handled != total or left:
        raise RuntimeError(f"pgqueuer handled {handled} jobs, expected {total}; {left} left")
    return total / elapsed


async def measure_pgqueuer_latency(options: BenchOptions, scratch: Scratch) -> dict[str, float]:
    """As nmbus's latency mode: enqueue at ``rate`` per second, open loop, from a pool of 8;
    milliseconds from the call of ``enqueue`` to the entrypoint's start."""
    import asyncio
    from datetime import timedelta

    from pgqueuer.adapters.drivers.asyncpg import AsyncpgDriver, AsyncpgPoolDriver
    from pgqueuer.core.qm import QueueManager
    from pgqueuer.queries import Queries

    from nmbus.bench.scenarios import latency_figures, open_loop, wait_until

    settings = {"search_path": scratch.schema}
    total = max(1, int(options.rate * (options.seconds + options.warmup)))
    skip = int(options.rate * options.warmup)
    started_at: dict[int, float] = {}
    called: dict[int, float] = {}
    returned: dict[int, float] = {}
    conn = await asyncpg.connect(options.dsn, server_settings=settings)
    pool = await asyncpg.create_pool(options.dsn, min_size=8, max_size=8, server_settings=settings)
    try:
        await Queries(AsyncpgDriver(conn)).install(create_schema=False)
        manager = QueueManager(Queries(AsyncpgDriver(conn)))

        @manager.entrypoint("bench")
        async def record(job: Any) -> None:
            started_at[int(job.payload)] = time.perf_counter()

        producer = Queries(AsyncpgPoolDriver(pool))
        worker = asyncio.create_task(
            manager.run(dequeue_timeout=timedelta(seconds=1), log_aggregation_interval=timedelta(0))
        )
        try:
            await asyncio.sleep(0.5)  # let the worker's listener connect

            async def send(n: int) -> None:
                called[n] = time.perf_counter()
                await producer.enqueue("bench", str(n).encode())
                returned[n] = time.perf_counter()

            await open_loop(send, options.rate, total)
            await wait_until(lambda: len(started_at) >= total, 60.0 + total / 200.0)
        finally:
            manager.shutdown.set()
            await asyncio.wait_for(worker, 30)
    finally:
        await pool.close()
        await conn.close()
    counted = range(skip, total) if total > skip else range(total)
    return latency_figures(started_at, called, returned, counted)
