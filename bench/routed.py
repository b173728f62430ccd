"""``python -m bench routed``: a send through the outbox and the forwarder, against a local send.

The same measurements twice in one run, on the same server: first the
receiving queue lives in the sender's database (the ceiling), then in a second
database that the bench creates (``nmbus_bench_<random>``) and drops, reached
through a route. Each time:

- latency: a producer sends at ``rate`` per second for ``seconds`` (after
  ``warmup``), open-loop; milliseconds from the call of ``send`` to the start
  of the receiver's handler, as p50 and p99;
- throughput: ``burst`` messages sent in transactions of ``batch_size``, as
  fast as one connection can; messages per second from the first send to the
  last handled.

The routed run adds the outbox row, the forwarder's wake-up (LISTEN/NOTIFY),
its remote transaction and the remote worker's wake-up.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from nmbus.bench.scenarios import drain_timeout, open_loop, percentile, wait_until
from nmbus.bench.scratch import QUEUE, BenchOptions, Scratch, Tick
from nmbus.bus import Bus
from nmbus.context import Context

BURST_MAX = 20_000


def _with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


async def _admin(dsn: str, statement: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


async def _run_once(
    options: BenchOptions, schema: str, remote: str | None, burst: int
) -> dict[str, float]:
    """Latency and burst throughput to QUEUE, in the local database or at ``remote``."""
    started_at: dict[int, float] = {}
    receiver_settings = options.bus_settings(schema, **({"dsn": remote} if remote else {}))
    receiver = Bus(QUEUE, settings=receiver_settings)

    @receiver.handler
    async def record(msg: Tick, ctx: Context) -> None:
        started_at[msg.n] = time.perf_counter()

    routes = {QUEUE: remote} if remote else None
    # With routes, the producer's bus runs the forwarder (a side task of its workers).
    producer = Bus(
        "bench_producer",
        settings=options.bus_settings(schema, concurrency=1 if remote else 0, send_pool_size=8),
        routes=routes,
    )

    @producer.handler
    async def nothing(msg: Tick, ctx: Context) -> None:
        pass

    total = max(1, int(options.rate * (options.seconds + options.warmup)))
    skip = int(options.rate * options.warmup)
    called: dict[int, float] = {}

    async def send(n: int) -> None:
        called[n] = time.perf_counter()
        await producer.send(Tick(n=n, sent=called[n]), to=QUEUE)

    async with receiver, producer:
        await asyncio.sleep(0.3)  # let the listeners connect
        await open_loop(send, options.rate, total)
        await wait_until(lambda: len(started_at) >= total, drain_timeout(total))
        counted = range(skip, total) if total > skip else range(total)
        latencies = [(started_at[n] - called[n]) * 1000.0 for n in counted]

        first = total
        last = first + burst
        t0 = time.perf_counter()
        chunk = options.batch_size or 100  # sends per transaction
        async with producer.store.pool.acquire() as conn:  # type: ignore[attr-defined]
            for start in range(first, last, chunk):
                async with conn.transaction():
                    for n in range(start, min(last, start + chunk)):
                        await producer.send(Tick(n=n, sent=0.0), to=QUEUE, connection=conn)
        await wait_until(lambda: len(started_at) >= last, drain_timeout(burst))
        elapsed = time.perf_counter() - t0
    return {
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "messages_per_s": burst / elapsed,
    }


async def measure_routed(
    options: BenchOptions, progress: Callable[[str], None]
) -> dict[str, float]:
    """A local send and a routed send, measured the same way in one run; with ratios."""
    burst = min(options.messages, BURST_MAX)
    database = f"nmbus_bench_{uuid.uuid4().hex[:10]}"
    async with Scratch(options.dsn) as scratch:
        progress("routed: local send (the ceiling)")
        local = await _run_once(options, scratch.schema, None, burst)
        await _admin(options.dsn, f'CREATE DATABASE "{database}"')
        try:
            progress("routed: send through the outbox and the forwarder")
            remote = _with_database(options.dsn, database)
            routed = await _run_once(options, scratch.schema, remote, burst)
        finally:
            await _admin(options.dsn, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    figures: dict[str, Any] = {
        "local_p50_ms": local["p50_ms"],
        "local_p99_ms": local["p99_ms"],
        "routed_p50_ms": routed["p50_ms"],
        "routed_p99_ms": routed["p99_ms"],
        "added_p50_ms": routed["p50_ms"] - local["p50_ms"],
        "local_messages_per_s": local["messages_per_s"],
        "routed_messages_per_s": routed["messages_per_s"],
        "throughput_ratio_to_local": routed["messages_per_s"] / local["messages_per_s"],
        "burst_messages": float(burst),
    }
    return figures
