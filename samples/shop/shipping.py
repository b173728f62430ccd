"""The shipping service: ships paid orders, publishes shop.OrderShipped.

It also follows every order event of the orders service by subscribing to the
base class shop.OrderEvent. It never defines shop.OrderPlaced: the publisher's
type-chain header lets it decode that subclass as the OrderEvent it knows.

    NMBUS_DSN=postgresql://... python -m samples.shop.shipping
"""

from __future__ import annotations

import asyncio

from nmbus import Bus, Context, Message
from samples.shop._service import configure_output, run_until_signal


class OrderEvent(Message, type_name="shop.OrderEvent"):
    order_id: int


class PaymentTaken(Message, type_name="shop.PaymentTaken"):
    order_id: int


class OrderShipped(Message, type_name="shop.OrderShipped"):
    order_id: int
    carrier: str


bus = Bus("shipping")
bus.subscribe(OrderEvent, publisher="orders")
bus.subscribe(PaymentTaken, publisher="billing")
bus.publishes(OrderShipped)  # for its contract document (nmbus asyncapi)


@bus.handler
async def note(msg: OrderEvent, ctx: Context) -> None:
    print(
        f"[shipping] heard {ctx.label} for order {msg.order_id} (decoded as {type(msg).__name__})"
    )


@bus.handler
async def ship(msg: PaymentTaken, ctx: Context) -> None:
    carrier = "parcel-post" if msg.order_id % 2 else "courier"
    await ctx.publish(OrderShipped(order_id=msg.order_id, carrier=carrier))
    print(f"[shipping] order {msg.order_id} paid, shipping by {carrier}")


async def main() -> None:
    await run_until_signal(bus)


if __name__ == "__main__":
    configure_output()
    asyncio.run(main())
