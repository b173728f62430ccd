"""``nmbus bench saga``: messages per second through a saga against the same handler without.

Kept apart from :mod:`nmbus.tools.bench` (which calls :func:`measure_saga` for
the ``saga`` mode). Both runs drain the same
pre-loaded messages with the same settings in the same scratch schema: one
with a handler that counts into a saga's state (lock, load, save on every
message, ``sagas`` sagas keyed by ``n % sagas``), one with the same handler
body and no saga. The ratio is the figure to read; the rates depend on the
machine.
"""

from __future__ import annotations

import time

from pydantic import BaseModel

from nmbus.bus import Bus
from nmbus.context import Context
from nmbus.tools.bench_scenarios import _deadline, wait_until
from nmbus.tools.bench_scratch import QUEUE, BenchOptions, Scratch, Tick
from nmbus.tools.sql import render

SAGAS = 100


class TickCount(BaseModel):
    count: int = 0
    last: int = 0


async def _drain(options: BenchOptions, scratch: Scratch, kind: str) -> float:
    total = options.messages
    await scratch.create_queue()
    await scratch.preload(total)
    await scratch.checkpoint()
    bus = Bus(QUEUE, settings=options.bus_settings(scratch.schema))
    first: list[float] = []
    counts: dict[int, TickCount] = {}
    with_saga = kind == "saga"
    bump = render("bench_bump_counter", scratch.schema)
    if kind == "table":
        await scratch.c.execute(render("bench_create_counters", scratch.schema))

        @bus.handler
        async def by_hand(msg: Tick, ctx: Context) -> None:
            if not first:
                first.append(time.perf_counter())
            await ctx.connection.execute(bump, msg.n % SAGAS)

    elif with_saga:
        saga = bus.saga(TickCount, key=lambda msg: msg.n % SAGAS)

        @saga.handler(start=True)
        async def in_saga(msg: Tick, state: TickCount, ctx: Context) -> None:
            if not first:
                first.append(time.perf_counter())
            state.count += 1
            state.last = msg.n

    else:

        @bus.handler
        async def plain(msg: Tick, ctx: Context) -> None:
            if not first:
                first.append(time.perf_counter())
            state = counts.setdefault(msg.n % SAGAS, TickCount())
            state.count += 1
            state.last = msg.n

    async with bus:
        await wait_until(lambda: bus.worker.handled >= total, _deadline(total))
        elapsed = time.perf_counter() - first[0]
        if with_saga:
            states = [await saga.load(k) for k in range(min(SAGAS, total))]
            counted = sum(state.count for state in states if state is not None)
            if counted != total:
                raise RuntimeError(f"the sagas counted {counted} messages, expected {total}")
    processed = await scratch.count("X")
    if processed != total:
        raise RuntimeError(f"saga bench processed {processed} messages, expected {total}")
    return total / elapsed


async def measure_saga(options: BenchOptions, fresh: type[Scratch]) -> dict[str, float]:
    """Saga vs plain handler, each drained in a scratch schema of its own."""
    rates: dict[str, float] = {}
    for kind in ("plain", "table", "saga"):
        async with fresh(options.dsn) as scratch:
            rates[kind] = await _drain(options, scratch, kind)
    return {
        "saga_per_s": rates["saga"],
        "plain_per_s": rates["plain"],
        "hand_written_table_per_s": rates["table"],
        "ratio_saga_to_plain": rates["saga"] / rates["plain"],
        "ratio_saga_to_hand_written": rates["saga"] / rates["table"],
    }
