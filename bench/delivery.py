"""``python -m bench delivery``: priority and sequences against a plain drain, in one run.

Kept apart from :mod:`nmbus.bench.runner` (which calls :func:`measure_delivery`
for the ``delivery`` mode). Three drains of pre-loaded rows, each in a fresh
scratch schema: plain, priorities mixed 0-9, and ``sequences`` interleaved
sequences of ``sequence_members`` each; rates and ratios to the plain drain.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from bench.options import Options
from bench.sql import render
from nmbus.bench.scenarios import drain_timeout, wait_until
from nmbus.bench.scratch import QUEUE, TICK, Scratch, noop_bus

ScratchRun = Callable[[str, Callable[[Scratch], Awaitable[Any]]], Awaitable[Any]]


async def measure_delivery_drain(
    options: Options, scratch: Scratch, *, priorities: int = 1, sequences: int = 0
) -> float:
    """Messages per second of a worker draining rows with priorities 0..``priorities``-1
    and, when ``sequences`` > 0, all in that many interleaved sequences."""
    total = sequences * options.sequence_members if sequences else options.messages
    await scratch.create_queue()
    prefix = f"d{uuid.uuid4().hex[:8]}-"
    await scratch.c.execute(
        render("bench_preload_delivery", scratch.schema, QUEUE),
        total,
        TICK,
        prefix,
        priorities,
        sequences,
    )
    await scratch.c.execute(render("bench_vacuum", scratch.schema, QUEUE))
    await scratch.checkpoint()
    bus, first = noop_bus(options, scratch.schema)
    async with bus:
        await wait_until(lambda: bus.worker.handled >= total, drain_timeout(total) * 4)
        elapsed = time.perf_counter() - first[0]
    processed = await scratch.count("X")
    if processed != total:
        raise RuntimeError(f"delivery drain processed {processed} messages, expected {total}")
    return total / elapsed


async def measure_delivery(
    options: Options, scratch_run: ScratchRun, progress: Callable[[str], None]
) -> dict[str, float]:
    """Plain, priority-mix and sequence drains in one run, with ratios to the plain one."""
    dsn = options.dsn
    progress("delivery: plain drain")
    plain = await scratch_run(dsn, lambda s: measure_delivery_drain(options, s))
    progress("delivery: priorities 0-9")
    mixed = await scratch_run(dsn, lambda s: measure_delivery_drain(options, s, priorities=10))
    progress(f"delivery: {options.sequences} sequences x {options.sequence_members}")
    seqs = await scratch_run(
        dsn, lambda s: measure_delivery_drain(options, s, sequences=options.sequences)
    )
    return {
        "plain_messages_per_s": plain,
        "priority_mix_messages_per_s": mixed,
        "priority_ratio_to_plain": mixed / plain,
        "sequences_messages_per_s": seqs,
        "sequences_ratio_to_plain": seqs / plain,
    }
