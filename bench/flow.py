"""``python -m bench flow``: flow control measured (docs/flow-control.md).

* ``concurrency``: 2 worker processes of 2 loops (``handler_concurrency`` 2)
  drain 400 messages of a handler with ``concurrency=5`` that takes 50 ms;
  from every handler's start and end: the most running at once, and the mean
  number running while the backlog lasted (how well the limit is held).
* ``rate``: the same 2 processes drain 1,000 messages of a handler with
  ``rate=200``: the achieved rate after the first full second, the most starts
  in any one second, and how long after a start leaves its window (the median)
  its room is used by the next start.
* ``groups``: 10,000 ready messages in 10,000 groups, handled by a handler
  with ``group_concurrency=1``: the limited claim's time (100 rows, rolled
  back), against the plain claim on the same rows.
* ``fairness``: 100,000 messages of one group, then 10 of another, drained by
  one loop (batch 100, no limit): how many of the big group's were handled
  before the last of the 10, and the drain's rate.

The worker processes are this module (``python -m bench.flow``),
the DSN in ``NMBUS_DSN``; each prints its handlers' start and end times.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

from bench.processes import go_and_report, worker_processes
from bench.sql import render
from nmbus.bench.scenarios import wait_until
from nmbus.bench.scratch import QUEUE, TICK, BenchOptions, Scratch, Tick
from nmbus.bus import Bus
from nmbus.context import Context
from nmbus.delivery.flow import GROUP_HEADER, FlowLimits, Limits
from nmbus.postgres import sql as core_sql
from nmbus.postgres.floor import read_floor
from nmbus.postgres.flow import claim_limited
from nmbus.postgres.sql import quote_ident

PROCESSES, LOOPS, AT_ONCE = 2, 2, 2
CONCURRENCY, CONCURRENCY_SLEEP, CONCURRENCY_MESSAGES = 5, 0.05, 400
RATE, RATE_MESSAGES = 200.0, 1_000
GROUPS = 10_000
FAIR_BIG, FAIR_SMALL = 100_000, 10


async def _processes(options: BenchOptions, scratch: Scratch, limits: str) -> list[list[float]]:
    """Run the worker processes on the scratch queue; (start, end) of every handler."""
    module = ["bench.flow", scratch.schema, limits]
    async with worker_processes(options.dsn, module, PROCESSES) as procs:
        reports = await go_and_report(procs, 300)
    return [span for report in reports for span in report]


def _worst_second(times: list[float]) -> int:
    """The most of ``times`` (sorted) in any one-second window."""
    most, first = 0, 0
    for last, t in enumerate(times):
        while times[first] <= t - 1.0:
            first += 1
        most = max(most, last - first + 1)
    return most


def _running(spans: list[list[float]]) -> tuple[int, float]:
    """The most handlers running at once, and the time-weighted mean while any ran."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    running, most, area = 0, 0, 0.0
    for (at, step), (after, _) in zip(events, [*events[1:], events[-1]], strict=True):
        running += step
        most = max(most, running)
        area += running * (after - at)
    return most, area / (events[-1][0] - events[0][0])


async def measure_flow(options: BenchOptions, scratch: Scratch) -> dict[str, float]:
    """Every figure of the flow mode, on one scratch schema."""
    figures: dict[str, float] = {}
    await scratch.create_queue()
    await scratch.preload(CONCURRENCY_MESSAGES)
    spans = await _processes(options, scratch, f"concurrency={CONCURRENCY}")
    if len(spans) != CONCURRENCY_MESSAGES:
        raise RuntimeError(f"handled {len(spans)} messages, expected {CONCURRENCY_MESSAGES}")
    most, mean = _running(spans)
    figures["concurrency_limit"] = CONCURRENCY
    figures["concurrency_most_running"] = most
    figures["concurrency_mean_running"] = mean
    ideal = CONCURRENCY_MESSAGES * CONCURRENCY_SLEEP / CONCURRENCY
    wall = max(e for _, e in spans) - min(s for s, _ in spans)
    figures["concurrency_wall_s"] = wall
    figures["concurrency_ideal_wall_s"] = ideal

    await scratch.preload(RATE_MESSAGES)
    spans = await _processes(options, scratch, f"rate={RATE}")
    starts = sorted(s for s, _ in spans)
    marks = sorted(
        r[0].timestamp()
        for r in await scratch.c.fetch(render("bench_flow_marks", scratch.schema), QUEUE)
    )
    figures["rate_limit_per_s"] = RATE
    # A full window of starts, then the rest: each start's room is used again when
    # it leaves the window, so the steady rate is taken from the end of the first
    # window (how fast the first one filled is not the limit's doing).
    full = int(RATE)
    figures["rate_achieved_per_s"] = (len(starts) - full) / (starts[-1] - starts[full - 1])
    reuse = [starts[i] - starts[i - full] - 1.0 for i in range(full, len(starts))]
    figures["rate_room_reused_after_ms"] = statistics.median(reuse) * 1000
    figures["rate_worst_one_second"] = _worst_second(starts)
    figures["rate_worst_one_second_of_marks"] = _worst_second(marks)
    figures.update(await _group_claim(scratch))
    return figures


async def measure_fairness(options: BenchOptions, scratch: Scratch) -> dict[str, float]:
    """FAIR_BIG messages of one group then FAIR_SMALL of another: when the small ones end."""
    await scratch.create_queue()
    preload = render("bench_preload_grouped", scratch.schema, QUEUE)
    await scratch.c.execute(preload, FAIR_BIG, TICK, GROUP_HEADER, "big", "big-")
    await scratch.c.execute(preload, FAIR_SMALL, TICK, GROUP_HEADER, "small", "small-")
    await scratch.checkpoint()
    bus = Bus(QUEUE, settings=options.bus_settings(scratch.schema, batch_size=100))
    order: list[bool] = []

    @bus.handler
    async def noop(msg: Tick, ctx: Context) -> None:
        order.append(ctx.group == "small")

    async with bus:
        started = time.perf_counter()
        await wait_until(lambda: len(order) >= FAIR_BIG + FAIR_SMALL, 600, 0.05)
        elapsed = time.perf_counter() - started
    last_small = max(i for i, small in enumerate(order) if small)
    return {
        "fairness_big_before_last_small": last_small + 1 - FAIR_SMALL,
        "fairness_drain_per_s": len(order) / elapsed,
    }


async def _group_claim(scratch: Scratch) -> dict[str, float]:
    """The limited claim's time with GROUPS groups ready, against the plain claim."""
    conn = scratch.c
    await conn.execute(
        render("bench_preload_grouped", scratch.schema, QUEUE),
        GROUPS,
        TICK,
        GROUP_HEADER,
        None,
        "own-",
    )
    await conn.execute(f"ANALYZE {quote_ident(scratch.schema)}.{quote_ident(QUEUE)}")
    flow = FlowLimits.of([("bench:handler", Limits(group_concurrency=1), [TICK])], 1)
    assert flow is not None
    floor = await read_floor(conn, scratch.schema, QUEUE)
    plain = core_sql.render("claim", scratch.schema, QUEUE)
    timings: dict[str, list[float]] = {"limited": [], "plain": []}
    for _ in range(20):
        for kind in ("limited", "plain"):
            tx = conn.transaction()
            await tx.start()
            try:
                started = time.perf_counter()
                if kind == "limited":
                    rows: Any = await claim_limited(
                        conn, scratch.schema, QUEUE, flow, 100, "bench", 30.0, floor
                    )
                else:
                    rows = await conn.fetch(plain, 100, "bench", 30.0, floor)
                timings[kind].append(time.perf_counter() - started)
            finally:
                await tx.rollback()
            if len(rows) != 100:
                raise RuntimeError(f"the {kind} claim took {len(rows)} rows, expected 100")
    return {
        "groups": GROUPS,
        "group_claim_ms": statistics.median(timings["limited"]) * 1000,
        "plain_claim_ms": statistics.median(timings["plain"]) * 1000,
    }


async def _work(schema: str, limits: str) -> None:
    options = BenchOptions(dsn=os.environ["NMBUS_DSN"], batch_size=10)
    settings = options.bus_settings(
        schema, concurrency=LOOPS, handler_concurrency=AT_ONCE, poll_interval=0.2
    )
    bus = Bus(QUEUE, settings=settings)
    name, _, value = limits.partition("=")
    spans: list[list[float]] = []
    sleep = CONCURRENCY_SLEEP if name == "concurrency" else 0.0

    if name == "rate":
        declare = bus.handler(rate=float(value))
    else:
        declare = bus.handler(concurrency=int(value))

    @declare
    async def limited(msg: Tick, ctx: Context) -> None:
        started = time.time()
        await asyncio.sleep(sleep)
        spans.append([started, time.time()])

    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    async with bus:
        while True:
            await asyncio.sleep(0.2)
            if not await bus.store.has_ready(QUEUE):
                break
    print(json.dumps(spans), flush=True)


if __name__ == "__main__":
    import logging

    import structlog

    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    asyncio.run(_work(sys.argv[1], sys.argv[2]))
