"""``python -m bench burst``: a burst that a worker, started on a quiet queue, drains.

The drain mode pre-loads its messages and analyzes the table before the worker
starts, so the worker plans its statements on a settled queue. A worker in
service plans them when it starts or when its queue is analyzed, which is most
often while the queue is quiet, and a burst then meets those plans. Three runs
of ``messages`` each, one scratch schema per run:

- ``settled``: as the drain mode (pre-loaded, analyzed, then the worker starts);
- ``new``: the worker starts on a new, empty queue, then the burst arrives;
- ``at_rest``: the queue holds ``REST_ROWS`` processed rows, analyzed (a queue
  at rest, as autovacuum leaves it), the worker starts, then the burst arrives.

The burst is stored in one statement and the worker woken at once; each run is
timed from the first handler call to the last message handled. The ratios
``new / settled`` and ``at_rest / settled`` are the figures to read.
"""

from __future__ import annotations

import asyncio
import time

from bench.sql import render
from nmbus.bench.scenarios import drain_timeout, wait_until
from nmbus.bench.scratch import QUEUE, TICK, BenchOptions, Scratch, noop_bus
from nmbus.postgres.listen import notify_channel

#: Processed rows of the queue at rest.
REST_ROWS = 50_000

KINDS = ("settled", "new", "at_rest")


async def _run(options: BenchOptions, scratch: Scratch, kind: str) -> float:
    total = options.messages
    await scratch.create_queue()
    if kind == "settled":
        await scratch.preload(total)  # analyzed with the rows in
    elif kind == "at_rest":
        await scratch.preload(REST_ROWS, "X")  # analyzed at rest
    await scratch.checkpoint()
    bus, first = noop_bus(options, scratch.schema)
    async with bus:
        if kind != "settled":
            # Each loop claims as it starts, and plans its claim then, on the quiet queue.
            await asyncio.sleep(1.0)
            await scratch.c.execute(
                render("bench_preload", scratch.schema, QUEUE), total, "I", TICK, "burst-"
            )
            channel = notify_channel(scratch.schema)
            await scratch.c.execute("SELECT pg_notify($1, $2)", channel, QUEUE)
        await wait_until(lambda: bus.worker.handled >= total, drain_timeout(total))
        elapsed = time.perf_counter() - first[0]
    processed = await scratch.count("X") - (REST_ROWS if kind == "at_rest" else 0)
    if processed != total:
        raise RuntimeError(f"the {kind} run processed {processed} messages, expected {total}")
    return total / elapsed


async def measure_burst(options: BenchOptions) -> dict[str, float]:
    """Messages per second of each kind of run, and each against ``settled``."""
    rates: dict[str, float] = {}
    for kind in KINDS:
        async with Scratch(options.dsn) as scratch:
            rates[kind] = await _run(options, scratch, kind)
    return {
        **{f"{kind}_per_s": rate for kind, rate in rates.items()},
        "ratio_new_to_settled": rates["new"] / rates["settled"],
        "ratio_at_rest_to_settled": rates["at_rest"] / rates["settled"],
    }
