"""Middleware: a tenant id from an HTTP request, through three services, on every log line.

A web front (a small Starlette app, with the bus endpoint ``mw_web``) takes
``POST /orders`` with an ``X-Tenant`` header and sends ``PlaceOrder`` to
``mw_orders``, which sends ``ChargeCard`` to ``mw_payments``, which replies
``CardCharged``. The same two pieces of middleware sit on every endpoint
(docs/middleware.md): ``@bus.middleware`` reads the tenant from the handled
message's headers into a context variable and binds it to structlog's context,
so that every line logged while handling carries it; ``@bus.outgoing`` writes
the context variable's tenant onto everything sent, and refuses a message sent
outside any tenant. Three orders of two tenants go through; every line printed
names its tenant and service.

    NMBUS_DSN=postgresql://... python -m samples.middleware
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import sys
from typing import Any

import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from nmbus import Bus, Context, InvalidMessage, Message
from nmbus.middleware import CallNext

TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar("tenant", default=None)
log = structlog.get_logger("samples.middleware")

#: The orders the sample places: (order id, tenant, amount).
ORDERS = [(1, "acme", 12.5), (2, "globex", 99.0), (3, "acme", 7.25)]


class PlaceOrder(Message, type_name="mw.PlaceOrder"):
    order_id: int
    amount: float


class ChargeCard(Message, type_name="mw.ChargeCard"):
    order_id: int
    amount: float


class CardCharged(Message, type_name="mw.CardCharged"):
    order_id: int


def with_tenant(bus: Bus) -> Bus:
    """The application's two pieces of middleware, on one of its endpoints."""

    @bus.middleware
    async def tenant_of_the_message(msg: Message, ctx: Context, call_next: CallNext) -> None:
        token = TENANT.set(ctx.headers.get("tenant"))
        try:
            with structlog.contextvars.bound_contextvars(tenant=TENANT.get(), service=bus.endpoint):
                await call_next()
        finally:
            TENANT.reset(token)

    @bus.outgoing
    async def tenant_onto_the_message(
        msg: Message, headers: dict[str, str], call_next: CallNext
    ) -> None:
        tenant = TENANT.get()
        if tenant is None:
            raise InvalidMessage(f"{msg.__type_name__} sent outside any tenant")
        headers["tenant"] = tenant
        await call_next()

    return bus


# The web front's endpoint (it only sends), orders and payments; NMBUS_DSN says where.
web = Bus("mw_web", concurrency=0)
orders = Bus("mw_orders", poll_interval=0.5)
payments = Bus("mw_payments", poll_interval=0.5)
for endpoint in (web, orders, payments):
    with_tenant(endpoint)
# For their contract documents (nmbus asyncapi samples.middleware:orders, ...).
web.sends(PlaceOrder, to="mw_orders")
orders.sends(ChargeCard, to="mw_payments")


class Paid:
    """The ids of the orders paid so far, and the event ``main`` waits on."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.all: asyncio.Event | None = None


paid = Paid()


@orders.handler
async def place(msg: PlaceOrder, ctx: Context) -> None:
    log.info("order_placed", order_id=msg.order_id)
    await ctx.send(ChargeCard(order_id=msg.order_id, amount=msg.amount), to="mw_payments")


@payments.handler
async def charge(msg: ChargeCard, ctx: Context) -> None:
    log.info("card_charged", order_id=msg.order_id, amount=msg.amount)
    await ctx.reply(CardCharged(order_id=msg.order_id))


@orders.handler
async def charged(msg: CardCharged, ctx: Context) -> None:
    log.info("order_paid", order_id=msg.order_id)
    paid.ids.append(msg.order_id)
    if paid.all is not None and len(paid.ids) >= len(ORDERS):
        paid.all.set()


def http_app(web: Bus) -> Starlette:
    """The web front: ``POST /orders`` in a tenant's name (its ``X-Tenant`` header)."""

    async def place_order(request: Request) -> JSONResponse:
        tenant = request.headers.get("x-tenant")
        if not tenant:
            return JSONResponse({"error": "the X-Tenant header is missing"}, status_code=400)
        body = await request.json()
        token = TENANT.set(tenant)
        try:
            with structlog.contextvars.bound_contextvars(tenant=tenant, service="http"):
                log.info("order_requested", order_id=body["order_id"])
                await web.send(
                    PlaceOrder(order_id=body["order_id"], amount=body["amount"]), to="mw_orders"
                )
        finally:
            TENANT.reset(token)
        return JSONResponse({"accepted": body["order_id"]}, status_code=202)

    return Starlette(routes=[Route("/orders", place_order, methods=["POST"])])


async def post(app: Any, path: str, body: object, headers: dict[str, str]) -> tuple[int, Any]:
    """One HTTP request through the app's ASGI interface (what a server would do)."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        + [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    sent = False
    status, chunks = 0, []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()  # no disconnect while the response is made
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, json.loads(b"".join(chunks) or b"null")


def configure_logging() -> None:
    """The application's logging: nmbus's own lines only from warnings up."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    logging.getLogger("nmbus").setLevel(logging.WARNING)
    structlog.configure(
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.contextvars.merge_contextvars,
            structlog.processors.KeyValueRenderer(key_order=["service", "tenant", "event"]),
        ],
    )


async def main() -> None:
    app = http_app(web)
    paid.all = asyncio.Event()
    async with web, orders, payments:
        for order_id, tenant, amount in ORDERS:
            status, answer = await post(
                app, "/orders", {"order_id": order_id, "amount": amount}, {"X-Tenant": tenant}
            )
            assert status == 202, answer
        async with asyncio.timeout(30):
            await paid.all.wait()
    assert set(paid.ids) == {order_id for order_id, _, _ in ORDERS}


if __name__ == "__main__":
    configure_logging()
    asyncio.run(main())
