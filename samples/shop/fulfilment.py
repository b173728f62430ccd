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
from dataclasses import dataclass, field

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


bus = Bus("fulfilment")
saga = bus.saga(Fulfilment, key="order_id")
bus.subscribe(OrderPlaced, publisher="orders")
bus.subscribe(PaymentTaken, publisher="billing")
bus.subscribe(OrderShipped, publisher="shipping")
bus.sends(PaymentOverdue, to="fulfilment")  # the saga's timeout (for nmbus asyncapi)


@dataclass
class Plan:
    """What ``main`` was asked for: how long a payment may take, how many orders to see."""

    payment_due: float = 5.0
    count: int = 0
    fulfilled: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)


plan = Plan()


def finish_if_done(state: Fulfilment, ctx: Context) -> None:
    if state.placed and state.paid and state.shipped:
        ctx.saga.complete()
        plan.fulfilled += 1
        print(
            f"[fulfilment] order {state.order_id} fulfilled ({plan.fulfilled}/{plan.count or '∞'})"
        )
        if plan.count and plan.fulfilled >= plan.count:
            plan.done.set()


@saga.handler(start=True)
async def placed(msg: OrderPlaced, state: Fulfilment, ctx: Context) -> None:
    state.order_id, state.customer, state.placed = msg.order_id, msg.customer, True
    await ctx.saga.timeout(plan.payment_due, PaymentOverdue(order_id=msg.order_id))
    print(f"[fulfilment] order {msg.order_id} placed, payment due in {plan.payment_due:g}s")
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


async def main(count: int, payment_due: float) -> None:
    plan.count, plan.payment_due = count, payment_due
    await run_until_signal(bus, plan.done)
    if count:
        print(f"[fulfilment] all {count} orders fulfilled")


if __name__ == "__main__":
    configure_output()
    parser = argparse.ArgumentParser(description="the fulfilment service (a saga per order)")
    parser.add_argument("--count", type=int, default=0, help="exit after this many, 0: never")
    parser.add_argument("--payment-due", type=float, default=5.0, help="seconds to pay an order")
    args = parser.parse_args()
    asyncio.run(main(args.count, args.payment_due))
