"""Saga worker processes started (and killed) by tests/test_sagas.py.

python -m tests.saga_workers counter DSN QUEUE CONCURRENCY BATCH KILL_ON
    count Increments into a Counter saga; the Increment numbered KILL_ON
    SIGKILLs the process on its first attempt, after the saga was loaded and
    before it is saved (-1: never)
python -m tests.saga_workers starts DSN QUEUE CONCURRENCY BATCH [KILL_ON,...]
    the same, but an Increment may start its Counter saga (start=True), and
    each Increment numbered in KILL_ON kills the process on its first attempt
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from pydantic import BaseModel

from nmbus import Bus, Context, Message


class Increment(Message, type_name="test.saga.Increment"):
    counter: str
    n: int


class Open(Message, type_name="test.saga.Open"):
    counter: str


class Counter(BaseModel):
    count: int = 0
    seen: list[int] = []
    pids: list[int] = []


def counter_bus(
    dsn: str, queue: str, kill_on: int | set[int] = -1, starts: bool = False, **settings: object
) -> Bus:
    pills = kill_on if isinstance(kill_on, set) else {kill_on}
    bus = Bus(queue, dsn=dsn, **settings)  # type: ignore[arg-type]
    saga = bus.saga(Counter, key="counter")

    @saga.handler(start=True)
    async def open_(msg: Open, state: Counter, ctx: Context) -> None:
        pass

    @saga.handler(start=starts)
    async def increment(msg: Increment, state: Counter, ctx: Context) -> None:
        state.count += 1
        state.seen.append(msg.n)
        if os.getpid() not in state.pids:
            state.pids.append(os.getpid())
        if msg.n in pills and ctx.retry_count == 1:
            print(f"killing at {msg.n}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        # Give the other loops and processes a chance to come at the same saga.
        await asyncio.sleep(0.002)

    return bus


async def counter(
    dsn: str,
    queue: str,
    concurrency: int,
    batch: int,
    kill_on: int | set[int],
    starts: bool = False,
    commit_interval: float = 0.5,
) -> None:
    bus = counter_bus(
        dsn,
        queue,
        kill_on,
        starts,
        concurrency=concurrency,
        batch_size=batch,
        lease_seconds=1.0,
        poll_interval=0.2,
        max_attempts=5,
        batch_commit_interval=commit_interval,
    )
    async with bus:
        print("ready", flush=True)
        await bus.wait_stopped()


if __name__ == "__main__":
    mode, dsn, queue = sys.argv[1:4]
    if mode == "counter":
        concurrency, batch, kill_on = (int(x) for x in sys.argv[4:7])
        asyncio.run(counter(dsn, queue, concurrency, batch, kill_on))
    elif mode == "starts":
        concurrency, batch = (int(x) for x in sys.argv[4:6])
        pills = {int(x) for x in sys.argv[6].split(",") if x} if len(sys.argv) > 6 else set()
        interval = float(sys.argv[7]) if len(sys.argv) > 7 else 0.5
        asyncio.run(counter(dsn, queue, concurrency, batch, pills, True, interval))
