"""Endpoints in two databases: orders in one, billing in another (docs/routes.md).

    NMBUS_DSN=postgresql://.../orders_db NMBUS_DB_B=postgresql://.../billing_db \\
        python -m samples.routes

Both services run in this process for brevity; each talks only to its own
database. ``orders`` knows that ``billing`` lives in database ``b`` (its route);
``billing`` knows where its publisher ``orders`` lives, so its subscription is
written into the orders database, where publish reads it. What orders sends
or publishes to billing goes into the outbox of the orders database, in the
sender's transaction, and the forwarder of the orders bus moves it exactly
once. Billing answers each charge with a ``Charged`` message routed back.
"""

from __future__ import annotations

import asyncio
import logging
import os

import structlog

from nmbus import Bus, Context, Message


class OrderPlaced(Message, type_name="shop.OrderPlaced"):
    order_id: int
    amount: float


class Charge(Message, type_name="shop.Charge"):
    order_id: int
    amount: float


class Charged(Message, type_name="shop.Charged"):
    order_id: int


ORDERS = 3


# NMBUS_ROUTES="billing=b" with NMBUS_DB_B says the same from the environment.
ORDERS_DSN, BILLING_DSN = os.environ["NMBUS_DSN"], os.environ["NMBUS_DB_B"]
orders = Bus("orders", dsn=ORDERS_DSN, routes={"billing": BILLING_DSN})
billing = Bus("billing", dsn=BILLING_DSN, routes={"orders": ORDERS_DSN})
billing.subscribe(OrderPlaced, publisher="orders")
# For their contract documents (nmbus asyncapi samples.routes:orders, ...:billing).
orders.publishes(OrderPlaced)
orders.sends(Charge, to="billing")
billing.sends(Charged, to="orders")
charged: list[int] = []
done = asyncio.Event()


@billing.handler
async def on_placed(msg: OrderPlaced, ctx: Context) -> None:
    print(f"[billing] saw order {msg.order_id} (published in the other database)")


@billing.handler
async def charge(msg: Charge, ctx: Context) -> None:
    print(f"[billing] charging {msg.amount:.2f} for order {msg.order_id}")
    await ctx.send(Charged(order_id=msg.order_id), to="orders")  # routed back


@orders.handler
async def on_charged(msg: Charged, ctx: Context) -> None:
    print(f"[orders] order {msg.order_id} charged (from {ctx.from_endpoint})")
    charged.append(msg.order_id)
    if len(charged) == ORDERS:
        done.set()


async def main() -> None:
    # The application, not the library, decides what gets logged: warnings and up.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    async with billing, orders:
        for n in range(1, ORDERS + 1):
            await orders.publish(OrderPlaced(order_id=n, amount=10.0 * n))
            await orders.send(Charge(order_id=n, amount=10.0 * n), to="billing")
        await asyncio.wait_for(done.wait(), timeout=30)
    print(f"[orders] all {ORDERS} orders charged across two databases")


if __name__ == "__main__":
    asyncio.run(main())
