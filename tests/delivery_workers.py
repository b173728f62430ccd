"""Worker processes for the delivery tests (tests/test_sequences.py, tests/test_periodic.py).

python -m tests.delivery_workers periodic DSN SECONDS
    run endpoint "clock" with @bus.periodic(every=1) for SECONDS; print each tick handled
python -m tests.delivery_workers sequence DSN FAILS
    handle test.Posted on "ledger" (concurrency 2, batch size 5); the members whose n is
    in FAILS (comma-separated) fail their first two attempts; print each start and finish
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time

from nmbus import Bus, Context, Tick
from tests.messages import Posted


async def periodic(dsn: str, seconds: float) -> None:
    bus = Bus("clock", dsn=dsn, poll_interval=0.5, lease_seconds=10)

    @bus.periodic(every=1)
    async def beat(tick: Tick, ctx: Context) -> None:
        print(f"tick {tick.name} {tick.scheduled_at.isoformat()} {os.getpid()}", flush=True)

    async with bus:
        print("ready", flush=True)
        await asyncio.sleep(seconds)
    print("stopped", flush=True)


async def sequence(dsn: str, fails: set[int]) -> None:
    bus = Bus(
        "ledger",
        dsn=dsn,
        concurrency=2,
        batch_size=5,
        handler_concurrency=2,
        poll_interval=0.2,
        lease_seconds=10,
        retry_delay=0.2,
        retry_max_delay=0.2,
        max_attempts=5,
    )

    @bus.handler
    async def on_posted(msg: Posted, ctx: Context) -> None:
        print(f"start {msg.seq} {msg.n} {ctx.retry_count} {time.time_ns()}", flush=True)
        await asyncio.sleep(random.uniform(0, 0.01))
        if msg.n in fails and ctx.retry_count <= 2:
            print(f"fail {msg.seq} {msg.n} {ctx.retry_count} {time.time_ns()}", flush=True)
            raise RuntimeError(f"member {msg.n} fails attempt {ctx.retry_count}")
        await ctx.connection.execute(
            "INSERT INTO seq_log (seq, n, pid) VALUES ($1, $2, $3)", msg.seq, msg.n, os.getpid()
        )
        print(f"done {msg.seq} {msg.n} {ctx.retry_count} {time.time_ns()}", flush=True)

    async with bus:
        print("ready", flush=True)
        await bus.wait_stopped()


if __name__ == "__main__":
    mode, dsn = sys.argv[1:3]
    if mode == "periodic":
        asyncio.run(periodic(dsn, float(sys.argv[3])))
    elif mode == "sequence":
        given = sys.argv[3] if len(sys.argv) > 3 else ""
        asyncio.run(sequence(dsn, {int(x) for x in given.split(",") if x}))
    else:
        raise SystemExit(f"unknown mode {mode}")
