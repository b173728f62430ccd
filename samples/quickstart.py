"""The README's first example: one endpoint sends itself orders and handles them.

NMBUS_DSN=postgresql://postgres@127.0.0.1:5432/test python -m samples.quickstart
"""

import asyncio
import logging

import structlog

from nmbus import Bus, Context, Message, PermanentError
from nmbus.testing import drain


class OrderPlaced(Message, type_name="shop.OrderPlaced"):
    order_id: int
    amount: float


class PaymentTaken(Message, type_name="shop.PaymentTaken"):
    order_id: int


bus = Bus("billing")  # the DSN comes from NMBUS_DSN; the queue table is nmbus.billing


@bus.handler(retry=3)
async def charge(msg: OrderPlaced, ctx: Context) -> None:
    if msg.amount <= 0:
        raise PermanentError(f"order {msg.order_id} has nothing to charge")
    await ctx.send(PaymentTaken(order_id=msg.order_id), to="billing")


@bus.handler
async def paid(msg: PaymentTaken, ctx: Context) -> None:
    print(f"order {msg.order_id} paid (correlation {ctx.correlation_id})")


async def main() -> None:
    # The application, not the library, decides what gets logged.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    async with bus:
        for order_id, amount in [(1, 9.5), (2, 0.0), (3, 12.0)]:
            await bus.send(OrderPlaced(order_id=order_id, amount=amount), to="billing")
        await drain(bus)
        print(await bus.store.counts("billing"))


if __name__ == "__main__":
    asyncio.run(main())
