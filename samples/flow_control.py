"""Flow control (docs/flow-control.md): a payment provider's rate, one job per tenant, cancel.

NMBUS_DSN=postgresql://postgres@127.0.0.1:5432/test python -m samples.flow_control

The payments endpoint may call its provider at most 20 times a second and
have at most 4 calls open at once (``rate=``, ``concurrency=``), and it runs at
most one export per tenant at a time (``group_concurrency=1``), while a
big tenant's backlog never stops a small tenant's export. An order cancelled
before its charge started is never charged (``bus.cancel``).
"""

import asyncio
import logging
import time

import structlog

from nmbus import Bus, Context, Message, Settings
from nmbus.ops.admin import Admin
from nmbus.testing import drain


class Charge(Message, type_name="payments.Charge"):
    order: str
    amount: float


class Export(Message, type_name="payments.Export"):
    tenant: str
    part: int


# Two loops, each running up to 4 handlers of a batch at once: room for the 4 calls.
payments = Bus("payments", concurrency=2, handler_concurrency=4, batch_size=10)
shop = Bus("shop", concurrency=0)  # sends only
shop.sends(Charge, Export, to="payments")  # for its contract document (nmbus asyncapi)
charged: list[float] = []
exporting: dict[str, int] = {}
most_at_once: dict[str, int] = {}
exported: list[str] = []


@payments.handler(rate=20.0, concurrency=4)
async def charge(msg: Charge, ctx: Context) -> None:
    charged.append(time.monotonic())
    await asyncio.sleep(0.05)  # the provider's call


@payments.handler(group_concurrency=1)
async def export(msg: Export, ctx: Context) -> None:
    tenant = ctx.group or "?"
    exporting[tenant] = exporting.get(tenant, 0) + 1
    most_at_once[tenant] = max(most_at_once.get(tenant, 0), exporting[tenant])
    await asyncio.sleep(0.02)
    exporting[tenant] -= 1
    exported.append(tenant)


async def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    async with Admin.from_settings(Settings()) as admin:
        await admin.create_queues(["payments"])
    async with shop:
        for n in range(60):
            await shop.send(
                Charge(order=f"order-{n}", amount=10.0), to="payments", unique_id=f"order-{n}"
            )
        cancelled = await shop.cancel("payments", unique_id="order-59")
        print(f"cancelled before it started: {cancelled}")
        for part in range(30):
            await shop.send(Export(tenant="big", part=part), to="payments", group="big")
        await shop.send(Export(tenant="small", part=0), to="payments", group="small")
    async with payments:
        await drain(payments, timeout=30)
    span = charged[-1] - charged[0]
    worst = max(sum(1 for t in charged if s <= t < s + 1.0) for s in charged)
    print(f"charged {len(charged)} orders in {span:.1f} s; at most {worst} in any second")
    print(f"exports running at once per tenant: {dict(sorted(most_at_once.items()))}")
    behind = exported.index("small")
    print(f"the small tenant's export waited for {behind} of the big tenant's 30, not all")


if __name__ == "__main__":
    asyncio.run(main())
