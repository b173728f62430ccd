"""Endpoints in processes of their own, for the publish/subscribe tests.

python -m tests.pubsub_workers subscriber DSN ENDPOINT TTL [base-only] PUBLISHER:TYPE...
    subscribe to each TYPE published by PUBLISHER, record every message handled
    in table ``received``, print "ready", run until killed. With ``base-only``
    the process never defines ps.OrderPlaced (it only knows its base ps.Event).
python -m tests.pubsub_workers publisher DSN ENDPOINT N
    publish N ps.OrderPlaced (n = 0..N-1), print "published n subscriber,..." each.

TTL is seconds, or "none" for permanent subscriptions.
"""

from __future__ import annotations

import asyncio
import functools
import sys

from nmbus import Bus, Context, Message


class Event(Message, type_name="ps.Event"):
    n: int


class Refund(Message, type_name="ps.Refund"):
    n: int


@functools.cache
def order_placed() -> type[Event]:
    """ps.OrderPlaced, defined only in processes that are meant to know it."""

    class OrderPlaced(Event, type_name="ps.OrderPlaced"):
        order_id: int

    return OrderPlaced


TYPES: dict[str, type[Message]] = {"ps.Event": Event, "ps.Refund": Refund}


async def subscriber(dsn: str, endpoint: str, ttl: float | None, specs: list[str]) -> None:
    bus = Bus(endpoint, dsn=dsn, subscription_ttl=ttl, poll_interval=0.5, lease_seconds=10)

    async def record(msg: Message, ctx: Context) -> None:
        await ctx.connection.execute(
            "INSERT INTO received (endpoint, unique_id, correlation_id, label, decoded_as, n) "
            "VALUES ($1, $2, $3, $4, $5, $6)",
            endpoint,
            ctx.unique_id,
            ctx.correlation_id,
            ctx.label,
            type(msg).__type_name__,
            getattr(msg, "n", None),
        )

    bus.handler(Event)(record)
    bus.handler(Refund)(record)
    for spec in specs:
        publisher, name = spec.split(":")
        bus.subscribe(TYPES[name], publisher=publisher)
    async with bus:
        print("ready", flush=True)
        await bus.wait_stopped()


async def publisher(dsn: str, endpoint: str, count: int) -> None:
    cls = order_placed()
    async with Bus(endpoint, dsn=dsn, concurrency=0) as bus:
        for n in range(count):
            subscribers = await bus.publish(cls(n=n, order_id=1000 + n))
            print(f"published {n} {','.join(subscribers)}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    mode, dsn, endpoint = sys.argv[1:4]
    if mode == "subscriber":
        ttl = None if sys.argv[4] == "none" else float(sys.argv[4])
        rest = sys.argv[5:]
        if rest and rest[0] == "base-only":
            rest = rest[1:]
        else:
            TYPES["ps.OrderPlaced"] = order_placed()
        asyncio.run(subscriber(dsn, endpoint, ttl, rest))
    else:
        asyncio.run(publisher(dsn, endpoint, int(sys.argv[4])))
