"""The fulfilment service: a saga per order, waiting for its payment and its shipment.

Every order gets a ``Fulfilment`` saga (a row of ``nmbus."fulfilment$saga"``)
that notes the payment and the shipment as they are published, and completes
once it has seen both. When an order is placed, a ``PaymentOverdue`` timeout is
set; if the payment has not come by then, the customer is reminded.

    NMBUS_DSN=postgresql://... python -m samples.shop.fulfilment --count 10

Payment and shipment are published by other services, so they may arrive in
any order, even before the order itself: every message may start the saga.
"""

from __future__ import annotations

import argparse
import asyncio

from pydantic import BaseModel

from nmbus import Bus, Context, Message
from samples.shop._service import configure_output, run_until_signal


class OrderPlaced(Message, type_name="shop.OrderPlaced"):
    order_id: int
    customer: str


class PaymentTaken(Message, type_name="shop.PaymentTaken"):
    order_id: int


class OrderShipped(Message, type_name="shop.OrderShipped"):
    order_id: int
    carrier: str


class PaymentOverdue(Message, type_name="shop.PaymentOverdue"):
    """The saga's timeout: sent to this endpoint, due ``--payment-due`` seconds on."""

    order_id: int


class Fulfilment(BaseModel):
    order_id: int = 0
    customer: str = ""
    placed: bool = False
    paid: bool = False
    shipped: bool = False
    reminded: bool = False


def fulfilment(
    payment_due: float, count: int = 0, dsn: str | None = None
) -> tuple[Bus, asyncio.Event]:
    """The endpoint, and what is set once ``count`` orders are fulfilled (0: never)."""
    bus = Bus("fulfilment", dsn=dsn)
    saga = bus.saga(Fulfilment, key="order_id")
    fulfilled = 0
    done = asyncio.Event()

    def finish_if_done(state: Fulfilment, ctx: Context) -> None:
        nonlocal fulfilled
        if state.placed and state.paid and state.shipped:
            ctx.saga.complete()
            fulfilled += 1
            print(f"[fulfilment] order {state.order_id} fulfilled ({fulfilled}/{count or '∞'})")
            if count and fulfilled >= count:
                done.set()

    @saga.handler(start=True)
    async def placed(msg: OrderPlaced, state: Fulfilment, ctx: Context) -> None:
        state.order_id, state.customer, state.placed = msg.order_id, msg.customer, True
        await ctx.saga.timeout(payment_due, PaymentOverdue(order_id=msg.order_id))
        print(f"[fulfilment] order {msg.order_id} placed, payment due in {payment_due:g}s")
        finish_if_done(state, ctx)

    @saga.handler(start=True)
    async def paid(msg: PaymentTaken, state: Fulfilment, ctx: Context) -> None:
        state.order_id, state.paid = msg.order_id, True
        print(f"[fulfilment] order {msg.order_id} paid" + (" (late)" if state.reminded else ""))
        finish_if_done(state, ctx)

    @saga.handler(start=True)
    async def shipped(msg: OrderShipped, state: Fulfilment, ctx: Context) -> None:
        state.order_id, state.shipped = msg.order_id, True
        finish_if_done(state, ctx)

    @saga.handler
    async def overdue(msg: PaymentOverdue, state: Fulfilment, ctx: Context) -> None:
        # Only a saga still running gets here: a completed one ignores its timeouts.
        if not state.paid:
            state.reminded = True
            print(f"[fulfilment] order {msg.order_id}: payment overdue, reminding {state.customer}")

    bus.subscribe(OrderPlaced, publisher="orders")
    bus.subscribe(PaymentTaken, publisher="billing")
    bus.subscribe(OrderShipped, publisher="shipping")
    return bus, done


async def main(count: int, payment_due: float) -> None:
    bus, done = fulfilment(payment_due, count)
    await run_until_signal(bus, done)
    if count:
        print(f"[fulfilment] all {count} orders fulfilled")


if __name__ == "__main__":
    configure_output()
    parser = argparse.ArgumentParser(description="the fulfilment service (a saga per order)")
    parser.add_argument("--count", type=int, default=0, help="exit after this many, 0: never")
    parser.add_argument("--payment-due", type=float, default=5.0, help="seconds to pay an order")
    args = parser.parse_args()
    asyncio.run(main(args.count, args.payment_due))
