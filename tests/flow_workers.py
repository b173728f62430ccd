"""Worker processes of the flow-control tests (tests/test_flow_control.py).

python -m tests.flow_workers DSN QUEUE CONCURRENCY RATE GROUP_CONCURRENCY SLEEP LEASE LOOPS

Handles Ping with the limits given ("-" for none), each taking SLEEP seconds,
and Pong with no limit and no sleep. Each handler start and end goes to table
flow_log (n, kind, grp, pid, started, ended) on a connection of its own, so the
times are there whatever the batch's transaction does.
"""

from __future__ import annotations

import asyncio
import os
import sys
from datetime import UTC, datetime

import asyncpg

from nmbus import Bus, Context
from tests.messages import Ping, Pong


def _limit(text: str, kind: type) -> object:
    return None if text == "-" else kind(text)


async def main(
    dsn: str, queue: str, conc: str, rate: str, gconc: str, sleep: str, lease: str, loops: str
) -> None:
    log = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    bus = Bus(
        queue,
        dsn=dsn,
        concurrency=int(loops),
        lease_seconds=float(lease),
        poll_interval=0.1,
        batch_size=10,
    )

    async def record(n: int, kind: str, ctx: Context, started: datetime) -> None:
        await log.execute(
            "INSERT INTO flow_log (n, kind, grp, pid, started, ended) "
            "VALUES ($1, $2, $3, $4, $5, $6)",
            n,
            kind,
            ctx.group,
            os.getpid(),
            started,
            datetime.now(UTC),
        )

    @bus.handler(
        concurrency=_limit(conc, int),  # type: ignore[arg-type]
        rate=_limit(rate, float),  # type: ignore[arg-type]
        group_concurrency=_limit(gconc, int),  # type: ignore[arg-type]
    )
    async def on_ping(msg: Ping, ctx: Context) -> None:
        started = datetime.now(UTC)
        print(f"started {msg.n}", flush=True)
        await asyncio.sleep(float(sleep))
        await record(msg.n, "ping", ctx, started)

    @bus.handler
    async def on_pong(msg: Pong, ctx: Context) -> None:
        await record(msg.n, "pong", ctx, datetime.now(UTC))

    async with bus:
        print("ready", flush=True)
        await bus.wait_stopped()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
