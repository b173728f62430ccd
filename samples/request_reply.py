"""Request/reply: a storefront asks the pricing endpoint for quotes and waits for each.

    NMBUS_DSN=postgresql://... python -m samples.request_reply

Both endpoints run in this process for brevity; they talk only through their
queue tables, so pricing could as well run elsewhere. The storefront sends
five requests at once: each reply comes back to its own queue with the
request's correlation id and resolves the matching ``bus.request``. Pricing
never quotes "unobtainium": that request times out. The storefront's tenant
header travels with the request onto the reply.
"""

from __future__ import annotations

import asyncio
import logging

import structlog

from nmbus import Bus, Context, Message


class GetQuote(Message, type_name="pricing.GetQuote"):
    item: str
    quantity: int


class Quote(Message, type_name="pricing.Quote"):
    item: str
    total: float


PRICES = {"apple": 0.5, "pear": 0.75, "fig": 1.2, "kiwi": 0.3, "plum": 0.4}


pricing = Bus("pricing")
storefront = Bus("storefront")  # must run workers: they receive the replies
storefront.sends(GetQuote, to="pricing")  # for its contract document (nmbus asyncapi)


@pricing.handler
async def quote(msg: GetQuote, ctx: Context) -> None:
    price = PRICES.get(msg.item)
    if price is None:
        print(f"[pricing] no price for {msg.item}: no reply")
        return
    print(f"[pricing] quoting {msg.quantity} x {msg.item} for {ctx.headers.get('tenant')}")
    await ctx.reply(Quote(item=msg.item, total=round(price * msg.quantity, 2)))


async def main() -> None:
    # The application, not the library, decides what gets logged: warnings and up.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    async with pricing, storefront:
        quotes = await asyncio.gather(
            *(
                storefront.request(
                    GetQuote(item=item, quantity=n + 1),
                    to="pricing",
                    timeout=10.0,
                    headers={"tenant": "acme"},
                )
                for n, item in enumerate(PRICES)
            )
        )
        for reply in quotes:
            assert isinstance(reply, Quote)
            print(f"[storefront] {reply.item}: {reply.total:.2f}")
        try:
            await storefront.request(
                GetQuote(item="unobtainium", quantity=1), to="pricing", timeout=1.0
            )
        except TimeoutError as exc:
            print(f"[storefront] {exc}")


if __name__ == "__main__":
    asyncio.run(main())
