"""``python -m bench.releases DSN``: what the release of parked sequence heads costs.

Prints two things, on a scratch schema dropped afterwards:

- the time of one ``release_sequences`` statement (it walks every sequence key
  with a member outside X) at 100, 1,000 and 10,000 such keys;
- how many of those statements a worker of 4 loops at ``poll_interval=0.5``
  runs a second, idle and then draining a backlog of sequenced and plain
  messages (the statement counted where the loops call it).

docs/design.md records the figures ("The release of parked sequence heads").
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import asyncpg

from nmbus import Bus, Context, Message
from nmbus.bench.scratch import Scratch
from nmbus.postgres.session import PostgresSession
from nmbus.postgres.sql import render

QUEUE = "releases"


class Member(Message, type_name="bench.releases.Member"):
    n: int


async def _send(bus: Bus, first: int, last: int, sequenced: bool = True) -> None:
    for start in range(first, last, 500):
        await asyncio.gather(
            *[
                bus.send(Member(n=n), to=QUEUE, sequence=f"k{n}" if sequenced else None)
                for n in range(start, min(last, start + 500))
            ]
        )


async def statement_times(dsn: str) -> None:
    async with (
        Scratch(dsn) as scratch,
        Bus(QUEUE, dsn=dsn, concurrency=0, schema_name=scratch.schema) as bus,
    ):
        sql = render("release_sequences", scratch.schema, QUEUE)
        sent = 0
        for keys in (100, 1_000, 10_000):
            await _send(bus, sent, keys)  # two members a key: the second one parked
            await _send(bus, sent, keys)
            sent = keys
            await scratch.c.execute(f'ANALYZE "{scratch.schema}"."{QUEUE}"')
            for _ in range(3):
                await scratch.c.fetchval(sql)
            began, runs = time.perf_counter(), 20
            for _ in range(runs):
                await scratch.c.fetchval(sql)
            ms = (time.perf_counter() - began) / runs * 1000
            print(f"release_sequences at {keys:>6,} sequence keys outside X: {ms:7.2f} ms")


async def statements_per_second(dsn: str) -> None:
    calls = 0
    real = PostgresSession.release_sequences

    async def counted(self: PostgresSession, queue: str) -> int:
        nonlocal calls
        calls += 1
        return await real(self, queue)

    PostgresSession.release_sequences = counted  # type: ignore[method-assign]
    try:
        async with Scratch(dsn) as scratch:
            bus = Bus(
                QUEUE,
                dsn=dsn,
                concurrency=4,
                poll_interval=0.5,
                batch_size=10,
                schema_name=scratch.schema,
            )

            @bus.handler
            async def handle(msg: Member, ctx: Context) -> None:
                await asyncio.sleep(0.001)

            async with bus:
                await asyncio.sleep(1.0)
                calls, began = 0, time.monotonic()
                await asyncio.sleep(5.0)
                idle = calls / (time.monotonic() - began)
                await _send(bus, 0, 3_000)
                await _send(bus, 3_000, 6_000, sequenced=False)
                calls, began = 0, time.monotonic()
                await asyncio.sleep(5.0)
                busy = calls / (time.monotonic() - began)
            print(f"4 loops, poll_interval 0.5: {idle:.1f} releases/s idle, {busy:.1f} busy")
    finally:
        PostgresSession.release_sequences = real  # type: ignore[method-assign]


async def main(dsn: str) -> None:
    # Quiet: the bus's start and stop lines are not figures.
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    await statement_times(dsn)
    await statements_per_second(dsn)


def _usage() -> Any:
    print("usage: python -m bench.releases DSN", file=sys.stderr)
    return 2


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(_usage())
    try:
        asyncio.run(main(sys.argv[1]))
    except (OSError, asyncpg.PostgresError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
