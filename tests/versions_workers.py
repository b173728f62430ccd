"""Two releases of one message type, in processes of their own, for the rolling-deploy test.

python -m tests.versions_workers old DSN QUEUE N
    the old release: send N versions.Order at version 1 (n = 0..N-1), print "done".
python -m tests.versions_workers new DSN QUEUE
    the new release: versions.Order at version 2 with an upcaster from 1; record
    each message handled in table ``versions_seen``, print "ready", run until killed.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from nmbus import Bus, Context, Message


def old_order() -> type[Message]:
    class Order(Message, type_name="versions.Order"):
        n: int

    return Order


def new_order() -> type[Message]:
    class Order(Message, type_name="versions.Order", version=2):
        n: int
        currency: str

    return Order


async def old(dsn: str, queue: str, count: int) -> None:
    cls = old_order()
    async with Bus(queue + "_sender", dsn=dsn, concurrency=0) as bus:
        for n in range(count):
            await bus.send(cls(n=n), to=queue)
    print("done", flush=True)


async def new(dsn: str, queue: str) -> None:
    cls = new_order()
    bus = Bus(queue, dsn=dsn, poll_interval=0.2, lease_seconds=10)

    @bus.upcaster("versions.Order", from_version=1)
    def add_currency(body: dict[str, object]) -> dict[str, object]:
        return {**body, "currency": "EUR"}

    async def record(msg: Any, ctx: Context) -> None:
        await ctx.connection.execute(
            "INSERT INTO versions_seen (n, currency) VALUES ($1, $2)",
            msg.n,
            msg.currency,
        )

    bus.handler(cls)(record)
    async with bus:
        print("ready", flush=True)
        await bus.wait_stopped()


if __name__ == "__main__":
    mode, dsn, queue = sys.argv[1:4]
    if mode == "old":
        asyncio.run(old(dsn, queue, int(sys.argv[4])))
    else:
        asyncio.run(new(dsn, queue))
