"""Worker and sender processes started (and killed) by the tests.

python -m tests.workers worker DSN QUEUE [lease]   handle Ping/Crash until killed
python -m tests.workers sender DSN QUEUE N          send N Pings, print each unique id
python -m tests.workers poison DSN QUEUE LEASE BATCH POISON [pure] [slow] [concurrent]
    handle Pings, recording each in effects; the Ping numbered POISON kills the process
    ("pure": the handler declares outside_effects=False, batches run without savepoints;
    "slow": each handler first sleeps 0.15 s, so a batch commits in parts;
    "concurrent": 3 handlers at once, the poison killing only once another row is X)
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import asyncpg

from nmbus import Bus, Context
from tests.messages import Crash, Ping, Slow
from tests.waits import wait_until


async def worker(dsn: str, queue: str, lease: float) -> None:
    bus = Bus(queue, dsn=dsn, lease_seconds=lease, poll_interval=0.5, max_attempts=3)

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        await ctx.connection.execute(
            "INSERT INTO effects (n, pid) VALUES ($1, $2)", msg.n, os.getpid()
        )

    @bus.handler
    async def on_crash(msg: Crash, ctx: Context) -> None:
        print(f"crashing {msg.n} attempt {ctx.retry_count}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    @bus.handler
    async def on_slow(msg: Slow, ctx: Context) -> None:
        print(f"started {msg.n}", flush=True)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            print(f"stopped {msg.n}", flush=True)
            raise

    async with bus:
        print("ready", flush=True)
        await bus.wait_stopped()


async def _some_row_committed(dsn: str, queue: str, cap: float = 20.0) -> None:
    """Wait (up to ``cap`` seconds) until a row of ``queue`` is X, seen from another connection."""
    conn = await asyncpg.connect(dsn)
    try:
        sql = f"SELECT count(*) FROM nmbus.\"{queue}\" WHERE subqueue = 'X'"
        await wait_until(sql, db=conn, timeout=cap)
    except AssertionError:  # not within cap: go on all the same
        pass
    finally:
        await conn.close()


async def poison(
    dsn: str,
    queue: str,
    lease: float,
    batch_size: int,
    pill: int,
    pure: bool = False,
    slow: bool = False,
    concurrent: bool = False,
) -> None:
    bus = Bus(
        queue,
        dsn=dsn,
        lease_seconds=lease,
        poll_interval=0.2,
        max_attempts=3,
        batch_size=batch_size,
        handler_concurrency=3 if concurrent else 1,
        # One loop: the batches the tests reason about are claimed one after another
        # (with two, the batch after the poison's would be in flight when it kills).
        concurrency=1,
    )

    @bus.handler(outside_effects=not pure)
    async def on_ping(msg: Ping, ctx: Context) -> None:
        print(f"ran {msg.n} attempt {ctx.retry_count}", flush=True)
        if slow:
            await asyncio.sleep(0.15)
        if msg.n == pill:
            if concurrent:
                await _some_row_committed(dsn, queue)
            os.kill(os.getpid(), signal.SIGKILL)
        await ctx.connection.execute(
            "INSERT INTO effects (n, pid) VALUES ($1, $2)", msg.n, os.getpid()
        )

    async with bus:
        print("ready", flush=True)
        await bus.wait_stopped()


async def sender(dsn: str, queue: str, count: int) -> None:
    async with Bus("sender", dsn=dsn, concurrency=0) as bus:
        print("ready", flush=True)
        for n in range(count):
            uid = await bus.send(Ping(n=n), to=queue)
            print(uid, flush=True)


if __name__ == "__main__":
    mode, dsn, queue = sys.argv[1:4]
    if mode == "worker":
        asyncio.run(worker(dsn, queue, float(sys.argv[4]) if len(sys.argv) > 4 else 2.0))
    elif mode == "poison":
        lease, batch_size, pill = float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
        extra = sys.argv[7:]
        asyncio.run(
            poison(
                dsn,
                queue,
                lease,
                batch_size,
                pill,
                "pure" in extra,
                "slow" in extra,
                "concurrent" in extra,
            )
        )
    else:
        asyncio.run(sender(dsn, queue, int(sys.argv[4])))
