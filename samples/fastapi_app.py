"""A FastAPI app with a bus in its lifespan, sending in the same transaction as its writes.

    pip install 'nmbus[fastapi]'
    NMBUS_DSN=postgresql://postgres@127.0.0.1:5432/test uvicorn samples.fastapi_app:app
    curl -s localhost:8000/orders -H 'content-type: application/json' \\
        -d '{"customer": "ada", "lines": [{"sku": "apple", "quantity": 3}]}'

The app keeps its own asyncpg pool, on the bus's database; the lifespan opens
it and starts the bus, and on shutdown stops the bus (its workers finish what
they hold) before closing the pool. ``POST /orders`` writes the order and its
lines and sends ``OrderPlaced`` to billing on one connection, in one
transaction: the message exists exactly when the order does. A line the
database refuses (a quantity of 0 breaks a CHECK) fails the request after the
order's row and the send: the transaction rolls back, and neither the order
nor the message is left. The bus's workers run in the app's process too:
billing's ``PaymentTaken`` marks the order paid, in the message's transaction.
docs/fastapi.md explains each part.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from nmbus import Bus, Context, Message


class OrderPlaced(Message, type_name="web.OrderPlaced"):
    order_id: int
    customer: str
    lines: int


class PaymentTaken(Message, type_name="web.PaymentTaken"):
    order_id: int


class Line(BaseModel):
    sku: str
    quantity: int  # the database checks that it is above 0


class NewOrder(BaseModel):
    customer: str
    lines: list[Line] = Field(min_length=1)


TABLES = """
CREATE TABLE IF NOT EXISTS web_orders (
    id bigserial PRIMARY KEY,
    customer text NOT NULL,
    paid boolean NOT NULL DEFAULT false
);
CREATE TABLE IF NOT EXISTS web_order_lines (
    order_id bigint NOT NULL REFERENCES web_orders (id),
    sku text NOT NULL,
    quantity integer NOT NULL CONSTRAINT quantity_above_zero CHECK (quantity > 0)
);
"""

bus = Bus("storefront")  # its DSN comes from NMBUS_DSN; its queue is nmbus.storefront
bus.sends(OrderPlaced, to="billing")  # for its contract document (nmbus asyncapi)


@bus.handler
async def paid(msg: PaymentTaken, ctx: Context) -> None:
    await ctx.connection.execute("UPDATE web_orders SET paid = true WHERE id = $1", msg.order_id)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    pool = await asyncpg.create_pool(bus.settings.dsn, min_size=1, max_size=10)
    try:
        await pool.execute(TABLES)
        app.state.pool = pool
        async with bus:  # started here; stopped (gracefully) when the app shuts down
            yield
    finally:
        await pool.close()


app = FastAPI(title="storefront", lifespan=lifespan)


@app.post("/orders", status_code=201)
async def place_order(order: NewOrder, request: Request) -> dict[str, int]:
    pool: asyncpg.Pool = request.app.state.pool
    # The transaction is the request's own, committed before the response is sent:
    # the client hears 201 only once the order and its message are both stored.
    async with pool.acquire() as conn, conn.transaction():
        order_id: int = await conn.fetchval(
            "INSERT INTO web_orders (customer) VALUES ($1) RETURNING id", order.customer
        )
        placed = OrderPlaced(order_id=order_id, customer=order.customer, lines=len(order.lines))
        await bus.send(placed, to="billing", connection=conn)
        await conn.executemany(
            "INSERT INTO web_order_lines (order_id, sku, quantity) VALUES ($1, $2, $3)",
            [(order_id, line.sku, line.quantity) for line in order.lines],
        )
    return {"order_id": order_id}


@app.get("/orders/{order_id}")
async def get_order(order_id: int, request: Request) -> dict[str, object]:
    pool: asyncpg.Pool = request.app.state.pool
    row = await pool.fetchrow("SELECT id, customer, paid FROM web_orders WHERE id = $1", order_id)
    if row is None:
        raise HTTPException(404, f"no order {order_id}")
    return dict(row)


@app.exception_handler(asyncpg.CheckViolationError)
async def refused(request: Request, exc: asyncpg.CheckViolationError) -> JSONResponse:
    # Raised inside the transaction, which rolled back on its way out.
    return JSONResponse({"detail": f"refused: {exc.constraint_name}"}, status_code=422)
