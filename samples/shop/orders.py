"""The orders service: places orders (publishes shop.OrderPlaced) and hears when they ship.

NMBUS_DSN=postgresql://... python -m samples.shop.orders --count 10
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from dataclasses import dataclass, field

from nmbus import Bus, Context, Message
from samples.shop._service import configure_output, run_until_signal


class OrderEvent(Message, type_name="shop.OrderEvent"):
    """Anything that happens to an order."""

    order_id: int


class OrderPlaced(OrderEvent, type_name="shop.OrderPlaced"):
    customer: str
    amount_cents: int


class OrderShipped(Message, type_name="shop.OrderShipped"):
    order_id: int
    carrier: str


bus = Bus("orders")
bus.subscribe(OrderShipped, publisher="shipping")
bus.publishes(OrderPlaced)  # for its contract document (nmbus asyncapi)


@dataclass
class Progress:
    """The orders shipped so far, of ``count`` placed (0: placing for ever)."""

    count: int = 0
    shipped: set[int] = field(default_factory=set)
    done: asyncio.Event = field(default_factory=asyncio.Event)


progress = Progress()


@bus.handler
async def on_shipped(msg: OrderShipped, ctx: Context) -> None:
    shipped, count = progress.shipped, progress.count
    shipped.add(msg.order_id)
    print(f"[orders] order {msg.order_id} shipped by {msg.carrier} ({len(shipped)}/{count})")
    if count and len(shipped) >= count:
        progress.done.set()


async def main(count: int, interval: float) -> None:
    progress.count = count

    async def place_orders() -> None:
        for order_id in range(1, count + 1) if count else itertools.count(1):
            order = OrderPlaced(order_id=order_id, customer=f"c{order_id % 7}", amount_cents=999)
            subscribers = await bus.publish(order, correlation_id=f"order-{order_id}")
            print(f"[orders] placed order {order_id} -> {', '.join(subscribers) or 'nobody'}")
            await asyncio.sleep(interval)

    await run_until_signal(bus, progress.done, place_orders)
    if count and len(progress.shipped) < count:
        print(f"[orders] stopped with {count - len(progress.shipped)} orders not shipped yet")
        raise SystemExit(1)
    if count:
        print(f"[orders] all {count} orders shipped")


if __name__ == "__main__":
    configure_output()
    parser = argparse.ArgumentParser(description="the orders service")
    parser.add_argument("--count", type=int, default=0, help="orders to place, 0: forever")
    parser.add_argument("--interval", type=float, default=0.3, help="seconds between orders")
    args = parser.parse_args()
    asyncio.run(main(args.count, args.interval))
