"""Publish/subscribe figures on this machine: a command that prints, never a test.

    NMBUS_DSN=postgresql://postgres@127.0.0.1:5432/postgres python -m samples.bench_publish

Works in a schema of its own (dropped afterwards): 3 subscribers, one publisher.
Prints messages published per second (each stored 3 times) for single publishes,
concurrent publishes, batched publish_many, and sends to 3 queues for comparison;
then how often a publish made right after a subscription committed reaches it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable

import asyncpg
import structlog

from nmbus import Bus, Message
from nmbus.postgres.sql import quote_ident


class Tick(Message, type_name="bench.Tick"):
    n: int
    payload: str = "x" * 100


async def timed(label: str, count: int, run: Callable[[], Awaitable[None]]) -> None:
    start = time.perf_counter()
    await run()
    seconds = time.perf_counter() - start
    print(f"{label:<46} {count:>7} msgs {seconds:7.2f} s {count / seconds:>9,.0f} msg/s")


async def main(dsn: str, total: int) -> None:
    schema = f"nmbus_bench_{os.getpid()}"
    common = {"dsn": dsn, "schema_name": schema, "concurrency": 0}
    subscribers = [Bus(name, **common) for name in ("billing", "shipping", "audit")]
    for bus in subscribers:
        bus.subscribe(Tick, publisher="orders")
        await bus.start()
    publisher = Bus("orders", send_pool_size=8, **common)
    await publisher.start()
    try:
        print(f"3 subscribers; body {len(Tick(n=0).model_dump_json())} bytes; schema {schema}")
        single = max(500, total // 20)

        async def sequential() -> None:
            for n in range(single):
                await publisher.publish(Tick(n=n))

        await timed("publish(), one at a time", single, sequential)

        async def concurrent() -> None:
            async def worker(offset: int) -> None:
                for n in range(offset, single * 2, 8):
                    await publisher.publish(Tick(n=n))

            await asyncio.gather(*(worker(i) for i in range(8)))

        await timed("publish(), 8 concurrent tasks", single * 2, concurrent)

        for size in (100, 1000):

            async def batched(size: int = size) -> None:
                for start in range(0, total, size):
                    await publisher.publish_many([Tick(n=n) for n in range(start, start + size)])

            await timed(f"publish_many(), batches of {size}", total, batched)

        async def batched_concurrent() -> None:
            async def worker(offset: int) -> None:
                for start in range(offset * 500, total, 500 * 4):
                    await publisher.publish_many([Tick(n=n) for n in range(start, start + 500)])

            await asyncio.gather(*(worker(i) for i in range(4)))

        await timed("publish_many(), batches of 500, 4 tasks", total, batched_concurrent)

        async def sends() -> None:
            for n in range(single):
                for queue in ("billing", "shipping", "audit"):
                    await publisher.send(Tick(n=n), to=queue)

        await timed("send() to each of 3 queues (comparison)", single, sends)

        conn = await asyncpg.connect(dsn)
        try:
            rows = await conn.fetch(
                f"SELECT count(*) FROM {quote_ident(schema)}.billing UNION ALL "
                f"SELECT count(*) FROM {quote_ident(schema)}.shipping UNION ALL "
                f"SELECT count(*) FROM {quote_ident(schema)}.audit"
            )
            print("rows stored per subscriber:", [r[0] for r in rows])
        finally:
            await conn.close()

        # How soon does a publisher see a new subscription? It looks subscribers up
        # in the publishing statement itself, so: the very next publish, every time.
        seen = 0
        rounds = 100
        lags = []
        for i in range(rounds):
            late = Bus(f"late{i}", **common)
            late.subscribe(Tick, publisher="orders")
            await late.start()  # returns once the subscription is committed
            t0 = time.perf_counter()
            subs = await publisher.publish(Tick(n=i))
            lags.append(time.perf_counter() - t0)
            seen += f"late{i}" in subs
            await late.unsubscribe(Tick, publisher="orders")
            await late.stop()
        lags.sort()
        print(
            f"new subscription seen by the first publish after its commit: {seen}/{rounds} "
            f"(that publish took median {lags[rounds // 2] * 1000:.2f} ms, "
            f"max {lags[-1] * 1000:.2f} ms)"
        )
    finally:
        await publisher.stop()
        for bus in subscribers:
            await bus.stop()
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f"DROP SCHEMA {quote_ident(schema)} CASCADE")
        finally:
            await conn.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("NMBUS_DSN"))
    parser.add_argument("--messages", type=int, default=50_000, help="for the batched runs")
    args = parser.parse_args()
    if not args.dsn:
        parser.error("set NMBUS_DSN or pass --dsn")
    # Figures only: the bus's own log lines would drown them.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    asyncio.run(main(args.dsn, args.messages))
