"""samples/fastapi_app.py through its ASGI interface, on the real PostgreSQL.

The app's lifespan runs as a server runs it (tests/asgi.py) and requests go
through httpx's ASGITransport: a request that succeeds stores its order and
its message; one that fails after its write stores neither and sends nothing;
the bus's workers run inside the app.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType

import asyncpg
import httpx
import pytest

from nmbus import Bus, Context, Message, Settings
from nmbus.ops.admin import Admin
from tests.asgi import lifespan
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parent.parent
GOOD = {"customer": "ada", "lines": [{"sku": "apple", "quantity": 3}]}
# The second line breaks the lines table's CHECK: after the order's row and the send.
BAD = {"customer": "bob", "lines": [{"sku": "pear", "quantity": 2}, {"sku": "fig", "quantity": 0}]}


@pytest.fixture
def storefront(dsn: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The sample, imported anew on this test's database: it builds its Bus when imported,
    from NMBUS_DSN, as a service does."""
    monkeypatch.setenv("NMBUS_DSN", dsn)
    import samples.fastapi_app as sample

    return importlib.reload(sample)


@asynccontextmanager
async def serving(sample: ModuleType) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=sample.app)
    async with (
        lifespan(sample.app),
        httpx.AsyncClient(transport=transport, base_url="http://storefront") as http,
    ):
        yield http


async def billing_queue(dsn: str) -> None:
    # Billing's queue exists, as it does once billing has run (`nmbus queues create`).
    async with Admin.from_settings(Settings(dsn=dsn)) as admin:
        await admin.create_queues(["billing"])


async def last_id(db: asyncpg.Connection, table: str) -> int:
    """The last value of ``table``'s id sequence: it moves on even in a rolled-back
    transaction, so it shows that a row was written and then undone."""
    value = await db.fetchval(
        "SELECT last_value FROM pg_sequences WHERE format('%I.%I', schemaname, sequencename)"
        "::regclass = pg_get_serial_sequence($1, 'id')::regclass",
        table,
    )
    return int(value or 0)


async def sent_order_ids(db: asyncpg.Connection) -> list[int]:
    rows = await db.fetch("SELECT label, msg_text FROM nmbus.billing ORDER BY id")
    assert {r["label"] for r in rows} <= {"web.OrderPlaced"}
    return [json.loads(r["msg_text"])["order_id"] for r in rows]


async def test_an_order_is_stored_with_its_message_and_the_apps_workers_mark_it_paid(
    storefront: ModuleType, dsn: str, db: asyncpg.Connection
) -> None:
    billing = Bus("billing", dsn=dsn)

    @billing.handler(storefront.OrderPlaced)
    async def charge(msg: Message, ctx: Context) -> None:
        assert isinstance(msg, storefront.OrderPlaced)
        await ctx.send(storefront.PaymentTaken(order_id=msg.order_id), to="storefront")

    async with serving(storefront) as http:
        response = await http.post("/orders", json=GOOD)
        assert response.status_code == 201, response.text
        order_id = response.json()["order_id"]
        # Committed before the answer: the order, its line and its message are there.
        assert await db.fetchval("SELECT customer FROM web_orders WHERE id = $1", order_id) == "ada"
        assert await db.fetchval("SELECT count(*) FROM web_order_lines") == 1
        assert await sent_order_ids(db) == [order_id]
        async with billing:
            # Billing answers; the storefront's workers, started by the app's lifespan,
            # mark the order paid.
            async def order() -> dict[str, object]:
                got = await http.get(f"/orders/{order_id}")
                assert got.status_code == 200, got.text
                data: dict[str, object] = got.json()
                return data

            await wait_until(order, until=lambda o: o["paid"] is True, timeout=30)
    # The lifespan's shutdown stopped the bus: its workers gave back nothing unfinished.
    assert storefront.bus.worker.handled >= 1
    assert await db.fetchval("SELECT count(*) FROM nmbus.storefront WHERE subqueue <> 'X'") == 0


async def test_a_request_that_fails_after_its_write_stores_nothing_and_sends_nothing(
    storefront: ModuleType, dsn: str, db: asyncpg.Connection
) -> None:
    await billing_queue(dsn)
    async with serving(storefront) as http:
        ok = await http.post("/orders", json=GOOD)
        assert ok.status_code == 201, ok.text
        orders, messages = await last_id(db, "web_orders"), await last_id(db, "nmbus.billing")
        bad = await http.post("/orders", json=BAD)
        assert bad.status_code == 422, bad.text
        assert bad.json() == {"detail": "refused: quantity_above_zero"}
        # It wrote its order and sent its message before its second line was refused:
        # both id sequences moved on (a sequence is not rolled back) ...
        assert await last_id(db, "web_orders") == orders + 1
        assert await last_id(db, "nmbus.billing") == messages + 1
        # ... and neither the order, nor its first line, nor its message is there.
        good_id = ok.json()["order_id"]
        assert [r[0] for r in await db.fetch("SELECT id FROM web_orders")] == [good_id]
        assert await db.fetchval("SELECT count(*) FROM web_order_lines") == 1
        assert await sent_order_ids(db) == [good_id]
        assert await db.fetchval("SELECT count(*) FROM nmbus.outbox") == 0


async def test_requests_at_once_each_keep_their_order_and_message_together(
    storefront: ModuleType, dsn: str, db: asyncpg.Connection
) -> None:
    await billing_queue(dsn)
    async with serving(storefront) as http:
        bodies = [GOOD if n % 2 else BAD for n in range(12)]
        responses = await asyncio.gather(*(http.post("/orders", json=b) for b in bodies))
    assert [r.status_code for r in responses] == [201 if n % 2 else 422 for n in range(12)]
    placed = sorted(r.json()["order_id"] for r in responses if r.status_code == 201)
    assert sorted(r[0] for r in await db.fetch("SELECT id FROM web_orders")) == placed
    assert sorted(await sent_order_ids(db)) == placed
    assert await last_id(db, "web_orders") == 12  # every request wrote its order


def test_the_fastapi_page_shows_the_samples_own_code() -> None:
    # docs/fastapi.md: every Python block is a part of samples/fastapi_app.py, as it is.
    page = (ROOT / "docs" / "fastapi.md").read_text(encoding="utf-8")
    sample = (ROOT / "samples" / "fastapi_app.py").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", page, re.DOTALL)
    assert len(blocks) == 2
    for block in blocks:
        assert block in sample, block.splitlines()[0]
