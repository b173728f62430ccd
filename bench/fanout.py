"""``python -m bench fanout``: publishers call ``Bus.publish``, then ``Bus.publish_many``.

Every message goes to ``subscribers`` queues; the figures are published
messages and stored rows per second, both ways.
"""

from __future__ import annotations

import asyncio
import time

from bench.options import Options
from nmbus.bench.scratch import Scratch, Tick
from nmbus.bus import Bus


async def measure_fanout(options: Options, scratch: Scratch) -> dict[str, float]:
    """``publishers`` tasks call Bus.publish; every message goes to ``subscribers`` queues."""
    subscribers = [f"bench_sub_{i}" for i in range(1, options.subscribers + 1)]
    buses = []
    for name in subscribers:
        sub = Bus(name, settings=options.bus_settings(scratch.schema, concurrency=0))
        sub.subscribe(Tick, publisher="bench_pub")
        buses.append(sub)
    publisher = Bus(
        "bench_pub",
        settings=options.bus_settings(
            # One spare: Bus.publish holds a connection while ensure_queue may want
            # another for a subscriber queue it has not seen yet.
            scratch.schema,
            concurrency=0,
            send_pool_size=options.publishers + 1,
        ),
    )
    total = options.fanout_messages
    for sub in buses:
        await sub.start()
    try:
        async with publisher:
            await publisher.publish(Tick(n=-1))  # connections and caches warm, not timed
            counter = iter(range(total))

            async def publish_loop() -> None:
                for n in counter:
                    await publisher.publish(Tick(n=n))

            started = time.perf_counter()
            await asyncio.gather(*(publish_loop() for _ in range(options.publishers)))
            elapsed = time.perf_counter() - started

            # The same messages again through publish_many: one statement and one
            # commit per fanout_batch messages, every copy still in its own row.
            batches = iter(range(0, total, options.fanout_batch))

            async def publish_many_loop() -> None:
                for first in batches:
                    last = min(total, first + options.fanout_batch)
                    await publisher.publish_many([Tick(n=n) for n in range(first, last)])

            started = time.perf_counter()
            await asyncio.gather(*(publish_many_loop() for _ in range(options.publishers)))
            batched_elapsed = time.perf_counter() - started
    finally:
        for sub in buses:
            await sub.stop()
    for name in subscribers:
        stored = await scratch.count("I", name)
        if stored != 2 * total + 1:
            raise RuntimeError(f"subscriber {name} got {stored} rows, expected {2 * total + 1}")
    return {
        "published_per_s": total / elapsed,
        "rows_per_s": total * len(subscribers) / elapsed,
        "batched_published_per_s": total / batched_elapsed,
        "batched_rows_per_s": total * len(subscribers) / batched_elapsed,
    }
