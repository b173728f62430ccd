"""Versions and upcasters: orders from the last release and this one, handled by this one.

The last release of the shop sent ``shop.OrderPlaced`` without a currency
(version 1). This release adds one (version 2) and registers an upcaster that
makes a stored version 1 body into a version 2 one before it is validated: the
orders the last release left in the queue are handled by the new handler as if
they had been sent in euros. The sample then counts the queue's messages by
version, with the SQL of docs/messages.md.

    NMBUS_DSN=postgresql://... python -m samples.versions
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import asyncpg
import structlog

from nmbus import Bus, Context, Message
from nmbus.testing import drain


def release(version: int) -> type[Message]:
    """``shop.OrderPlaced`` as release ``version`` of the code defines it."""
    if version == 1:

        class OrderPlaced(Message, type_name="versions.shop.OrderPlaced"):
            order_id: int
            amount: float

    else:

        class OrderPlaced(Message, type_name="versions.shop.OrderPlaced", version=2):  # type: ignore[no-redef]
            order_id: int
            amount: float
            currency: str

    return OrderPlaced


OldOrderPlaced = release(1)  # what the last release sent
OrderPlaced = release(2)  # this release's class

bus = Bus("versions_shop")


@bus.upcaster("versions.shop.OrderPlaced", from_version=1)
def add_currency(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "currency": "EUR"}  # every order before version 2 was in euros


@bus.handler(OrderPlaced)
async def charge(msg: Any, ctx: Context) -> None:
    print(f"order {msg.order_id}: {msg.amount:.2f} {msg.currency}")


BY_VERSION = """
SELECT coalesce((msg_headers->>'nmbus-version')::int, 1) AS version, count(*) AS messages
FROM nmbus.versions_shop GROUP BY 1 ORDER BY 1
"""


async def main() -> None:
    # The application, not the library, decides what gets logged.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    async with bus:
        await bus.send(OldOrderPlaced(order_id=1, amount=12.5), to="versions_shop")
        await bus.send(OldOrderPlaced(order_id=2, amount=7.25), to="versions_shop")
        await bus.send(OrderPlaced(order_id=3, amount=99.0, currency="USD"), to="versions_shop")
        await drain(bus)
    db = await asyncpg.connect(os.environ["NMBUS_DSN"])
    try:
        for row in await db.fetch(BY_VERSION):
            n = row["messages"]
            print(f"version {row['version']}: {n} message{'' if n == 1 else 's'}")
    finally:
        await db.close()


if __name__ == "__main__":
    asyncio.run(main())
