"""Request/reply and headers that travel, on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

import asyncpg
import pytest

from nmbus import Bus, ConfigurationError, Context, Message
from nmbus.testing import drain
from tests.waits import wait_until


class GetQuote(Message, type_name="test.rr.GetQuote"):
    item: str
    wait: float = 0.0


class Quote(Message, type_name="test.rr.Quote"):
    item: str
    price: float


class Step(Message, type_name="test.rr.Step"):
    hop: int


def pricing_bus(make_bus: Callable[..., Bus], **settings: object) -> Bus:
    bus = make_bus("pricing", poll_interval=0.2, **settings)

    @bus.handler
    async def quote(msg: GetQuote, ctx: Context) -> None:
        if msg.wait:
            await asyncio.sleep(msg.wait)
        if msg.item != "silent":
            await ctx.reply(Quote(item=msg.item, price=float(len(msg.item))))

    return bus


async def test_a_round_trip(make_bus: Callable[..., Bus], db: asyncpg.Connection) -> None:
    async with pricing_bus(make_bus), make_bus("shop", poll_interval=0.2) as shop:
        started = time.monotonic()
        reply = await shop.request(GetQuote(item="apple"), to="pricing", timeout=10.0)
        elapsed = time.monotonic() - started
    assert reply == Quote(item="apple", price=5.0)
    assert elapsed < 5.0
    row = await db.fetchrow("SELECT subqueue, correlation_id, msg_headers FROM nmbus.shop")
    assert row["subqueue"] == "X"
    request = await db.fetchrow("SELECT correlation_id, unique_id FROM nmbus.pricing")
    assert row["correlation_id"] == request["correlation_id"]
    assert json.loads(row["msg_headers"])["nmbus-in-reply-to"] == request["unique_id"]


async def test_twenty_concurrent_requests_each_get_their_own_answer(
    make_bus: Callable[..., Bus],
) -> None:
    items = [f"item-{'x' * n}" for n in range(20)]
    async with (
        pricing_bus(make_bus, concurrency=2, batch_size=5),
        make_bus("shop", poll_interval=0.2) as shop,
    ):
        replies = await asyncio.gather(
            *(shop.request(GetQuote(item=item), to="pricing", timeout=20.0) for item in items)
        )
        assert len(shop.replies) == 0
    assert replies == [Quote(item=item, price=float(len(item))) for item in items]


async def test_a_request_times_out(make_bus: Callable[..., Bus]) -> None:
    async with pricing_bus(make_bus), make_bus("shop", poll_interval=0.2) as shop:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no reply from 'pricing'"):
            await shop.request(GetQuote(item="silent"), to="pricing", timeout=0.5)
        assert 0.5 <= time.monotonic() - started < 3.0
        assert len(shop.replies) == 0


async def test_a_late_reply_goes_to_x_with_a_note_or_to_its_handler(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    handled: list[Quote] = []
    async with pricing_bus(make_bus), make_bus("shop", poll_interval=0.2) as shop:
        with pytest.raises(TimeoutError):
            await shop.request(GetQuote(item="late", wait=1.0), to="pricing", timeout=0.3)
        await drain(shop, queues=["pricing", "shop"])
        await wait_until("SELECT count(*) FROM nmbus.shop WHERE subqueue = 'X'", db=db, timeout=10)
    row = await db.fetchrow("SELECT subqueue, error_info FROM nmbus.shop")
    assert row["subqueue"] == "X"
    assert row["error_info"].startswith("late reply: no request waits for correlation id")

    shop2 = make_bus("shop2", poll_interval=0.2)

    @shop2.handler
    async def on_quote(msg: Quote, ctx: Context) -> None:
        handled.append(msg)

    async with pricing_bus(make_bus), shop2:
        with pytest.raises(TimeoutError):
            await shop2.request(GetQuote(item="later", wait=1.0), to="pricing", timeout=0.3)
        await wait_until(lambda: handled, timeout=10)
    assert handled == [Quote(item="later", price=5.0)]


async def test_a_reply_claimed_by_another_process_of_the_endpoint_reaches_its_request(
    make_bus: Callable[..., Bus],
) -> None:
    # Two buses of one endpoint stand for two processes: either may claim a reply.
    async with (
        pricing_bus(make_bus),
        make_bus("shop", poll_interval=0.1) as one,
        make_bus("shop", poll_interval=0.1) as two,
    ):
        assert one.client_id != two.client_id
        replies = await asyncio.gather(
            *(one.request(GetQuote(item=f"i{n}"), to="pricing", timeout=20.0) for n in range(10))
        )
        await drain(two)
    assert [r.item for r in replies if isinstance(r, Quote)] == [f"i{n}" for n in range(10)]
    # The other process handed every reply it claimed back, and handled none.
    assert two.worker.outcomes["X"] == 0


async def test_request_needs_workers_and_a_sane_timeout(make_bus: Callable[..., Bus]) -> None:
    async with make_bus("shop", concurrency=0) as shop:
        with pytest.raises(ConfigurationError, match="concurrency >= 1"):
            await shop.request(GetQuote(item="x"), to="pricing", timeout=1.0)
        for bad in (0, -1, float("nan"), float("inf")):
            with pytest.raises(ConfigurationError, match="timeout"):
                await shop.request(GetQuote(item="x"), to="pricing", timeout=bad)


async def test_an_explicit_reply_to_sends_the_answer_elsewhere(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    async with pricing_bus(make_bus) as pricing, make_bus("shop", concurrency=0) as shop:
        await shop.send(GetQuote(item="pear"), to="pricing", reply_to="audit")
        await drain(pricing)
    row = await db.fetchrow("SELECT from_endpoint, label, msg_text FROM nmbus.audit")
    assert (row["from_endpoint"], row["label"]) == ("pricing", "test.rr.Quote")
    # Without reply-to, a reply goes back to the sender.
    async with pricing_bus(make_bus) as pricing, make_bus("shop", concurrency=0) as shop:
        await shop.send(GetQuote(item="fig"), to="pricing")
        await drain(pricing)
    assert await db.fetchval("SELECT label FROM nmbus.shop") == "test.rr.Quote"


async def test_headers_travel_across_two_hops(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    seen: list[tuple[int, str | None, dict[str, str]]] = []
    first, second, third = (make_bus(n, poll_interval=0.2) for n in ("first", "second", "third"))

    @first.handler
    async def hop1(msg: Step, ctx: Context) -> None:
        seen.append((1, ctx.correlation_id, dict(ctx.headers)))
        await ctx.send(Step(hop=2), to="second")

    @second.handler
    async def hop2(msg: Step, ctx: Context) -> None:
        seen.append((2, ctx.correlation_id, dict(ctx.headers)))
        # A handler overrides a header; the others still travel.
        await ctx.send(Step(hop=3), to="third", headers={"tenant": "override"})
        await ctx.publish(Step(hop=30))

    @third.handler
    async def hop3(msg: Step, ctx: Context) -> None:
        seen.append((msg.hop, ctx.correlation_id, dict(ctx.headers)))

    third.subscribe(Step, publisher="second")
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with first, second, third, make_bus("app", concurrency=0) as app:
        await app.send(
            Step(hop=1),
            to="first",
            headers={"tenant": "acme", "traceparent": trace},
            correlation_id="conv-1",
            reply_to="app",
        )
        await wait_until(lambda: len(seen), until=lambda n: n >= 4, timeout=15)
    by_hop = {hop: (cid, headers) for hop, cid, headers in seen}
    assert all(cid == "conv-1" for cid, _ in by_hop.values())
    assert by_hop[1][1] == {"tenant": "acme", "traceparent": trace, "nmbus-reply-to": "app"}
    # nmbus's own headers (the reply address) stay with their message.
    assert by_hop[2][1] == {"tenant": "acme", "traceparent": trace}
    assert by_hop[3][1] == {"tenant": "override", "traceparent": trace}
    assert by_hop[30][1] == {"tenant": "acme", "traceparent": trace}


async def test_a_reply_carries_the_requests_headers(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    async with pricing_bus(make_bus), make_bus("shop", poll_interval=0.2) as shop:
        await shop.request(
            GetQuote(item="kiwi"), to="pricing", timeout=10.0, headers={"tenant": "acme"}
        )
    headers = json.loads(await db.fetchval("SELECT msg_headers FROM nmbus.shop"))
    assert headers["tenant"] == "acme"
    assert "nmbus-reply-to" not in headers


async def test_hand_written_headers_that_are_not_an_object_do_not_break_sends(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    first = make_bus("first", poll_interval=0.2)

    @first.handler
    async def hop1(msg: Step, ctx: Context) -> None:
        await ctx.send(Step(hop=2), to="second")

    async with first:
        for n, headers in enumerate(('["a"]', '"text"', "null", '{"tenant": 5, "ok": "yes"}')):
            await db.execute(
                "INSERT INTO nmbus.first (from_endpoint, to_endpoint, label, msg_text, "
                "msg_headers) VALUES ('op', 'first', 'test.rr.Step', $1, $2::jsonb)",
                json.dumps({"hop": n}),
                headers,
            )
        await drain(first)
    rows = await db.fetch("SELECT subqueue FROM nmbus.first ORDER BY id")
    assert [r["subqueue"] for r in rows] == ["X", "X", "X", "X"]
    sent = await db.fetch("SELECT msg_headers FROM nmbus.second ORDER BY id")
    # A header whose value is not a string does not travel; the others do.
    assert [r["msg_headers"] for r in sent] == [None, None, None, '{"ok": "yes"}']


async def test_a_bad_reply_address_fails_the_sender_not_the_batch(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("first", poll_interval=0.2, max_attempts=1)

    @bus.handler
    async def hop1(msg: Step, ctx: Context) -> None:
        await ctx.send(Step(hop=2), to="second", reply_to='x"; DROP TABLE y')

    async with bus:
        await bus.send(Step(hop=1), to="first")
        await drain(bus)
    info = await db.fetchval("SELECT error_info FROM nmbus.first")
    assert info.startswith("InvalidQueueName: invalid queue name")


async def test_replies_of_slow_handlers_do_not_wait_for_their_whole_batch(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # 100 requests in one batch of the default size, each handled in 50 ms: the
    # batch takes 5 s or more. The last handler waits for the first request to be
    # answered; before, replies were sent only when the whole batch committed.
    count = 100
    first_answered = asyncio.Event()
    seen: list[bool] = []
    async with make_bus("pricing", concurrency=0):
        pass  # its queue, so that the requests wait there before a worker runs
    # A fixed batch: one claim takes every request (an adaptive loop starts at 10).
    pricing = make_bus("pricing", poll_interval=0.2, batch_size=100)

    @pricing.handler
    async def quote(msg: GetQuote, ctx: Context) -> None:
        await asyncio.sleep(0.05)
        if msg.item == f"i{count - 1}":
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(20):
                    await first_answered.wait()
            seen.append(first_answered.is_set())
        await ctx.reply(Quote(item=msg.item, price=1.0))

    async def ask(shop: Bus, n: int) -> Message:
        reply = await shop.request(GetQuote(item=f"i{n}"), to="pricing", timeout=60.0)
        if n == 0:
            first_answered.set()
        return reply

    async with make_bus("shop", poll_interval=0.2) as shop:
        asking = [asyncio.create_task(ask(shop, n)) for n in range(count)]
        await wait_until(
            "SELECT count(*) FROM nmbus.pricing",
            db=db,
            until=lambda n: n >= count,
            timeout=20,
            interval=0.02,
        )
        assert pricing.settings.batch_size >= count
        async with pricing:
            replies = await asyncio.gather(*asking)
    assert [r.item for r in replies if isinstance(r, Quote)] == [f"i{n}" for n in range(count)]
    # One claim took them all, and the first answer came before the last was handled.
    assert seen == [True]


async def test_a_reply_is_handed_back_for_an_hour_at_most_whatever_its_deadline(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # A reply for another process of "shop" that names a deadline in the year 9999
    # (a forged header, or a request with an absurd timeout whose process died).
    async with make_bus("pricing", concurrency=0) as pricing, make_bus("shop", concurrency=0):
        await pricing.send(Quote(item="old", price=1.0), to="shop", correlation_id="c-old")
        await pricing.send(Quote(item="young", price=1.0), to="shop", correlation_id="c-young")
    headers = {
        "nmbus-in-reply-to": "some-request",
        "nmbus-requester": "a-process-that-is-gone",
        "nmbus-reply-by": "9999-12-31T23:59:59+00:00",
    }
    await db.execute("UPDATE nmbus.shop SET msg_headers = $1", json.dumps(headers))
    await db.execute(
        "UPDATE nmbus.shop SET insert_time = now() - interval '61 minutes' "
        "WHERE correlation_id = 'c-old'"
    )
    async with make_bus("shop", poll_interval=0.2) as shop:
        await wait_until(
            lambda: shop.worker.handled, until=lambda n: n >= 2, timeout=20, interval=0.02
        )
    rows = {
        r["correlation_id"]: r
        for r in await db.fetch(
            "SELECT correlation_id, subqueue, retry_count, error_info FROM nmbus.shop"
        )
    }
    # Sent more than an hour ago: late, to X with a note, never back to R again.
    assert rows["c-old"]["subqueue"] == "X"
    assert rows["c-old"]["error_info"].startswith("late reply:")
    # A young one still goes back for its requester, its attempt not counted.
    assert rows["c-young"]["subqueue"] == "R"
    assert rows["c-young"]["retry_count"] == 0


async def test_a_reply_whose_batch_runs_again_after_a_conflict_is_not_handled_again(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # The reply is handed to its request; then the batch's finish loses a
    # serialization failure (once) and the batch runs again under its claim. The
    # request has its answer: the reply goes to X, not to Quote's handler too.
    shop = make_bus("shop", poll_interval=0.2)
    handled: list[str] = []

    @shop.handler
    async def quoted(msg: Quote, ctx: Context) -> None:
        handled.append(msg.item)

    async with shop, pricing_bus(make_bus):
        await db.execute("CREATE SEQUENCE finishes")
        await db.execute(
            "CREATE FUNCTION conflict_once() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.subqueue = 'X' THEN IF nextval('finishes') = 1 THEN RAISE EXCEPTION "
            "'could not serialize' USING ERRCODE = 'serialization_failure'; END IF; "
            "END IF; RETURN NEW; END $$"
        )
        await db.execute(
            "CREATE TRIGGER conflict_once BEFORE UPDATE ON nmbus.shop "
            "FOR EACH ROW EXECUTE FUNCTION conflict_once()"
        )
        answer = await shop.request(GetQuote(item="tea"), to="pricing", timeout=20)
        await drain(shop, timeout=20)
    assert answer == Quote(item="tea", price=3.0)
    assert await db.fetchval("SELECT last_value FROM finishes") == 2  # the conflict happened
    row = await db.fetchrow("SELECT subqueue, retry_count FROM nmbus.shop")
    assert tuple(row) == ("X", 1)
    assert handled == []
