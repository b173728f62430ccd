"""nmbus.testing's HandlerTest and SagaScenario: an endpoint's own handling without a
worker or a database (docs/testing.md, levels 1 and 2), and the same outcomes as a
worker on PostgreSQL."""

from __future__ import annotations

import contextvars
import json
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from pydantic import BaseModel, Field

from nmbus import Bus, ConfigurationError, Context, Message, PermanentError, RetryLater, RetryPolicy
from nmbus.middleware import CallNext
from nmbus.testing import HandlerTest, SagaScenario, drain

#: A DSN nothing listens on: a HandlerTest never opens the bus's store.
NOWHERE = "postgresql://nobody@127.0.0.1:1/nothing"
T0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
POLICY = RetryPolicy(max_attempts=3, initial_delay=10.0, backoff=2.0, jitter=0.0)
TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("tenant", default="-")


class Order(Message, type_name="test.ht.Order"):
    order_id: int
    amount: int = 1


class Charge(Message, type_name="test.ht.Charge"):
    order_id: int


class Receipt(Message, type_name="test.ht.Receipt"):
    order_id: int


class Reminder(Message, type_name="test.ht.Reminder"):
    order_id: int
    n: int


class Paid(Message, type_name="test.ht.Paid"):
    order_id: int


class Refund(Message, type_name="test.ht.Refund"):
    cents: int = Field(gt=0)


def shop(dsn: str = NOWHERE, **settings: object) -> Bus:
    """An endpoint with middleware, an outgoing hook and three handlers."""
    bus = Bus("ht_shop", dsn=dsn, retry=POLICY, **settings)  # type: ignore[arg-type]

    @bus.middleware
    async def tenant(msg: Message, ctx: Context, call_next: CallNext) -> None:
        if ctx.headers.get("tenant") == "blocked":
            return  # processed without its handlers
        token = TENANT.set(ctx.headers.get("tenant", "none"))
        try:
            await call_next()
        finally:
            TENANT.reset(token)

    @bus.outgoing
    async def stamp(msg: Message, headers: dict[str, str], call_next: CallNext) -> None:
        headers["seen-tenant"] = TENANT.get()
        await call_next()

    @bus.handler
    async def order(msg: Order, ctx: Context) -> None:
        if msg.amount < 0:
            raise ValueError(f"amount {msg.amount} of order {msg.order_id}")
        if msg.amount == 0:
            raise PermanentError("nothing to charge")
        if msg.amount == 99:
            raise RetryLater(seconds=5, reason="provider busy")
        await ctx.send(
            Charge(order_id=msg.order_id), to="billing", delay=60, group="g1", priority=3
        )
        await ctx.publish(Receipt(order_id=msg.order_id))
        await ctx.reply(Receipt(order_id=msg.order_id))

    @bus.handler
    async def paid(msg: Paid, ctx: Context) -> None:
        await ctx.connection.execute("SELECT 1")

    @bus.handler
    async def refund(msg: Refund, ctx: Context) -> None:
        pass

    return bus


async def test_handler_test_runs_middleware_hooks_and_records_what_was_sent() -> None:
    t = HandlerTest(shop(), now=lambda: T0)
    outcome = await t.handle(Order(order_id=7), headers={"tenant": "acme"}, from_endpoint="web")
    assert outcome.processed and t.outcome == outcome
    [sent] = t.sent
    assert sent.message == Charge(order_id=7) and sent.to == "billing"
    # The tenant travelled onto the send; the hook saw the middleware's context variable.
    assert sent.headers == {"tenant": "acme", "seen-tenant": "acme"}
    assert sent.delay == 60.0 and sent.deliver_at == T0 + timedelta(seconds=60)
    assert (sent.group, sent.priority) == ("g1", 3)
    [published] = t.published
    assert published.message == Receipt(order_id=7) and published.to is None
    [reply] = t.replies
    assert reply.to == "web" and reply.correlation_id == sent.correlation_id
    assert t.timeouts == []


async def test_a_middleware_that_stops_leaves_the_message_processed_without_handlers() -> None:
    t = HandlerTest(shop())
    outcome = await t.handle(Order(order_id=1, amount=-1), headers={"tenant": "blocked"})
    assert outcome.processed
    assert t.sent == [] and t.published == [] and t.replies == []


async def test_a_handler_that_raises_gives_the_retry_time_of_the_bus_policy() -> None:
    t = HandlerTest(shop(), now=lambda: T0)
    first = await t.handle(Order(order_id=1, amount=-5))
    assert first.retrying and first.retry_at == T0 + timedelta(seconds=10)
    assert first.error == "ValueError: amount -5 of order 1"
    assert "in order" in (first.error_info or "")  # the handler's frame in the traceback
    second = await t.handle(Order(order_id=1, amount=-5), attempt=2)
    assert second.retry_at == T0 + timedelta(seconds=20)
    last = await t.handle(Order(order_id=1, amount=-5), attempt=3)
    assert last.failed and last.retry_at is None and last.error == first.error
    permanent = await t.handle(Order(order_id=1, amount=0))
    assert permanent.failed and permanent.error == "PermanentError: nothing to charge"
    later = await t.handle(Order(order_id=1, amount=99))
    assert later.retrying and later.retry_at == T0 + timedelta(seconds=5)
    # A failed message's sends are rolled back with it: nothing recorded.
    assert t.sent == [] and t.published == [] and t.replies == []


async def test_the_body_is_validated_as_a_worker_validates_it() -> None:
    t = HandlerTest(shop())
    bad = Refund.model_construct(cents=-1)  # skips validation when built
    outcome = await t.handle(bad)
    assert outcome.failed
    assert (outcome.error or "").startswith(
        "UndecodableMessage: body is not a valid test.ht.Refund"
    )
    assert (await t.handle(Refund(cents=1))).processed


async def test_a_handler_using_the_connection_is_told_to_use_postgresql() -> None:
    t = HandlerTest(shop())
    outcome = await t.handle(Paid(order_id=1))
    assert outcome.retrying
    assert (outcome.error or "").startswith(
        "ConfigurationError: HandlerTest runs without a database"
    )


async def test_handler_test_gives_what_a_worker_on_postgresql_records(
    dsn: str, db: asyncpg.Connection
) -> None:
    """The same messages through HandlerTest and through a real worker: the same
    outcomes, error lines and sends."""
    t = HandlerTest(shop())
    cases = [Order(order_id=1), Order(order_id=2, amount=-1), Order(order_id=3, amount=0)]
    expected = [await t.handle(m, headers={"tenant": "acme"}) for m in cases]
    bus = shop(dsn, poll_interval=0.5, concurrency=1)
    async with bus:
        for m in cases:
            await bus.send(m, to="ht_shop", headers={"tenant": "acme"})
        await drain(bus)
    got = await db.fetch(
        "SELECT subqueue, error_info FROM nmbus.ht_shop WHERE label = 'test.ht.Order' ORDER BY id"
    )
    status = {"X": "processed", "R": "retry", "F": "failed"}
    assert [status[r["subqueue"]] for r in got] == [o.status for o in expected]
    assert [(r["error_info"] or "").split("\n")[0] or None for r in got] == [
        o.error for o in expected
    ]
    [charge] = await db.fetch("SELECT msg_text, msg_headers FROM nmbus.billing")
    assert Charge.model_validate_json(charge["msg_text"]) == t.sent[0].message
    stored = {k: v for k, v in json.loads(charge["msg_headers"]).items() if "nmbus" not in k}
    assert stored == t.sent[0].headers


# -- sagas -----------------------------------------------------------------------------


class Checkout(BaseModel):
    order_id: int = 0
    paid: bool = False
    reminders: list[int] = []


def checkout_bus() -> Bus:
    bus = Bus("ht_checkout", dsn=NOWHERE)
    saga = bus.saga(Checkout, key="order_id")

    @saga.handler(start=True)
    async def placed(msg: Order, state: Checkout, ctx: Context) -> None:
        state.order_id = msg.order_id
        # Set out of order: the later one first.
        await ctx.saga.timeout(7200, Reminder(order_id=msg.order_id, n=2))
        await ctx.saga.timeout(3600, Reminder(order_id=msg.order_id, n=1))

    @saga.handler
    async def remind(msg: Reminder, state: Checkout, ctx: Context) -> None:
        state.reminders.append(msg.n)
        await ctx.send(Charge(order_id=msg.order_id), to="billing")

    @saga.handler
    async def paid(msg: Paid, state: Checkout, ctx: Context) -> None:
        state.paid = True
        ctx.saga.complete()

    return bus


async def test_saga_timeouts_fire_only_after_the_clock_passes_them_in_due_order() -> None:
    s = SagaScenario(checkout_bus(), key=5, start=T0)
    assert s.state is None and not s.completed
    assert (await s.handle(Order(order_id=5))).processed
    assert s.state == Checkout(order_id=5)
    assert [p.delay for p in s.pending] == [3600.0, 7200.0]
    assert await s.advance(timedelta(minutes=59, seconds=59)) == []
    assert s.state == Checkout(order_id=5) and s.test.sent == []
    [first] = await s.advance(timedelta(seconds=1))  # exactly due
    assert first.processed and s.state == Checkout(order_id=5, reminders=[1])
    assert s.now == T0 + timedelta(hours=1)
    [second] = await s.advance(timedelta(hours=5))
    assert second.processed and s.state == Checkout(order_id=5, reminders=[1, 2])
    assert [sent.message for sent in s.test.sent] == [Charge(order_id=5)] * 2
    assert s.now == T0 + timedelta(hours=6) and s.pending == []


async def test_two_timeouts_due_in_one_advance_run_in_due_order() -> None:
    s = SagaScenario(checkout_bus(), key=6, start=T0)
    await s.handle(Order(order_id=6))
    ran = await s.advance(timedelta(days=1))
    assert len(ran) == 2 and s.state == Checkout(order_id=6, reminders=[1, 2])


async def test_a_completed_sagas_late_timeout_does_nothing() -> None:
    s = SagaScenario(checkout_bus(), key=8, start=T0)
    await s.handle(Order(order_id=8))
    await s.handle(Paid(order_id=8))
    assert s.completed and s.state is None
    ran = await s.advance(timedelta(hours=3))
    assert [o.status for o in ran] == ["processed", "processed"]
    assert all((o.error_info or "").startswith("saga timeout ignored") for o in ran)
    assert s.state is None and s.test.sent == []


async def test_a_saga_message_for_no_saga_fails_and_a_scenario_needs_its_saga() -> None:
    s = SagaScenario(checkout_bus(), key=9)
    outcome = await s.handle(Paid(order_id=9))
    assert outcome.failed and (outcome.error or "").startswith("SagaNotFound")
    with pytest.raises(ConfigurationError, match="has 0 sagas"):
        SagaScenario(Bus("ht_none", dsn=NOWHERE), key=1)
    with pytest.raises(ConfigurationError, match="timedelta"):
        await s.advance(timedelta(seconds=-1))


async def test_a_saga_handler_that_fails_in_a_scenario_keeps_the_state_it_had() -> None:
    bus = checkout_bus()
    saga = bus.sagas["Checkout"]

    @saga.handler
    async def charge(msg: Charge, state: Checkout, ctx: Context) -> None:
        state.paid = True
        raise RuntimeError("card declined")

    s = SagaScenario(bus, key=3)
    await s.handle(Order(order_id=3))
    outcome = await s.handle(Charge(order_id=3))
    assert outcome.retrying and outcome.error == "RuntimeError: card declined"
    assert s.state == Checkout(order_id=3)


def test_a_scenario_runs_without_an_event_loop_of_its_own() -> None:
    """Built outside any loop (at import, in a fixture), awaited in the test's."""
    import asyncio

    s = SagaScenario(checkout_bus(), key=4, start=T0)

    async def run() -> None:
        await s.handle(Order(order_id=4))
        await s.advance(timedelta(hours=1))

    asyncio.run(run())
    assert s.state == Checkout(order_id=4, reminders=[1])
