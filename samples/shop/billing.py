"""The billing service: charges every placed order, publishes shop.PaymentTaken.

Its payment gateway fails every third order's first attempt, and one attempt
in five at random; the bus retries the
message (0.2 s, then 0.4 s, ...) until the charge goes through.

    NMBUS_DSN=postgresql://... python -m samples.shop.billing
"""

from __future__ import annotations

import asyncio
import random

from nmbus import Bus, Context, Message, RetryPolicy
from samples.shop._service import configure_output, run_until_signal


# Billing's own view of the orders service's event: only the fields it needs.
class OrderPlaced(Message, type_name="shop.OrderPlaced"):
    order_id: int
    amount_cents: int


class PaymentTaken(Message, type_name="shop.PaymentTaken"):
    order_id: int
    amount_cents: int


class GatewayTimeout(Exception):
    pass


bus = Bus("billing")
bus.subscribe(OrderPlaced, publisher="orders")
bus.publishes(PaymentTaken)  # for its contract document: nmbus asyncapi samples.shop.billing:bus


@bus.handler(retry=RetryPolicy(max_attempts=8, initial_delay=0.2, max_delay=2.0))
async def charge(msg: OrderPlaced, ctx: Context) -> None:
    # Every third order's first attempt fails, and any attempt may (one in five).
    if (ctx.retry_count == 1 and msg.order_id % 3 == 0) or random.random() < 0.2:
        print(f"[billing] order {msg.order_id}: gateway timeout (attempt {ctx.retry_count})")
        raise GatewayTimeout(f"payment gateway timed out for order {msg.order_id}")
    await ctx.publish(PaymentTaken(order_id=msg.order_id, amount_cents=msg.amount_cents))
    print(
        f"[billing] order {msg.order_id}: charged {msg.amount_cents / 100:.2f} "
        f"(attempt {ctx.retry_count}, correlation {ctx.correlation_id})"
    )


async def main() -> None:
    await run_until_signal(bus)


if __name__ == "__main__":
    configure_output()
    asyncio.run(main())
