"""Middleware on a real PostgreSQL: ``@bus.middleware`` around every handling,
``@bus.outgoing`` around every outgoing message (docs/middleware.md)."""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest
from pydantic import BaseModel

from nmbus import (
    Bus,
    ConfigurationError,
    Context,
    HandlerError,
    InvalidMessage,
    Message,
    RetryPolicy,
)
from nmbus.middleware import CallNext
from nmbus.testing import drain

TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar("tenant", default=None)

#: Retries far away: a failed message stays in R, where the test looks at it.
LATER = RetryPolicy(max_attempts=5, initial_delay=3600.0, max_delay=3600.0, jitter=0.0)


class Job(Message, type_name="test.mw.Job"):
    n: int


class Done(Message, type_name="test.mw.Done"):
    n: int


class Ask(Message, type_name="test.mw.Ask"):
    n: int


class Answer(Message, type_name="test.mw.Answer"):
    n: int


async def rows(db: asyncpg.Connection, queue: str) -> list[asyncpg.Record]:
    return await db.fetch(
        f'SELECT subqueue, error_info, msg_text, msg_headers FROM nmbus."{queue}" ORDER BY id'
    )


async def make_table(db: asyncpg.Connection) -> None:
    await db.execute("CREATE TABLE IF NOT EXISTS mw_writes (who text)")


async def test_middleware_runs_in_order_around_the_handlers_and_sets_what_they_see(
    make_bus: Callable[..., Bus],
) -> None:
    bus = make_bus("mw_order")
    seen: list[str] = []

    @bus.middleware
    async def outer(msg: Message, ctx: Context, call_next: CallNext) -> None:
        seen.append("outer in")
        token = TENANT.set(ctx.headers.get("tenant"))
        try:
            await call_next()
        finally:
            TENANT.reset(token)
            seen.append("outer out")

    @bus.middleware
    async def inner(msg: Message, ctx: Context, call_next: CallNext) -> None:
        seen.append(f"inner in {TENANT.get()}")
        await call_next()
        seen.append("inner out")

    @bus.handler
    async def handle(msg: Job, ctx: Context) -> None:
        seen.append(f"handler {msg.n} tenant={TENANT.get()}")

    async with bus:
        with pytest.raises(ConfigurationError, match="before the bus starts"):
            bus.middleware(outer)
        with pytest.raises(ConfigurationError, match="before the bus starts"):
            bus.outgoing(outer)
        await bus.send(Job(n=1), to="mw_order", headers={"tenant": "t1"})
        await drain(bus)
    assert seen == [
        "outer in",
        "inner in t1",
        "handler 1 tenant=t1",
        "inner out",
        "outer out",
    ]
    assert TENANT.get() is None


def test_what_cannot_be_a_middleware_is_refused_when_registered() -> None:
    from nmbus.testing import MemoryStore

    bus = Bus("mw_refused", store=MemoryStore())

    async def gen(msg: Message, ctx: Context, call_next: CallNext) -> Any:
        yield

    def plain(msg: Message, ctx: Context, call_next: CallNext) -> None: ...

    async def two(msg: Message, ctx: Context) -> None: ...

    with pytest.raises(HandlerError, match="not an async generator"):
        bus.middleware(gen)
    with pytest.raises(HandlerError, match="must be an async function"):
        bus.middleware(plain)
    with pytest.raises(HandlerError, match=r"exactly \(msg, ctx, call_next\)"):
        bus.middleware(two)  # type: ignore[arg-type]
    with pytest.raises(HandlerError, match=r"exactly \(msg, headers, call_next\)"):
        bus.outgoing(two)  # type: ignore[arg-type]
    assert bus.registry.middleware == () and bus.envelopes.hooks == ()


@pytest.mark.parametrize("where", ["before", "after"])
async def test_a_middleware_that_raises_fails_the_message_as_its_handler_would(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, where: str
) -> None:
    await make_table(db)
    bus = make_bus("mw_raise", retry=LATER)
    ran: list[int] = []

    @bus.middleware
    async def guard(msg: Message, ctx: Context, call_next: CallNext) -> None:
        if where == "before":
            raise ValueError("refused before the handler")
        await call_next()
        raise ValueError("refused after the handler")

    @bus.handler
    async def handle(msg: Job, ctx: Context) -> None:
        ran.append(msg.n)
        await ctx.connection.execute("INSERT INTO mw_writes VALUES ('handler')")
        await ctx.send(Done(n=msg.n), to="mw_raise_out")

    async with bus:
        await bus.send(Job(n=1), to="mw_raise")
        await drain(bus)
    [row] = await rows(db, "mw_raise")
    assert row["subqueue"] == "R"
    assert row["error_info"].startswith(f"ValueError: refused {where} the handler")
    assert ran == ([] if where == "before" else [1])
    # The handler's write and its send went with the failed attempt.
    assert await db.fetchval("SELECT count(*) FROM mw_writes") == 0
    assert await db.fetchval("SELECT to_regclass('nmbus.mw_raise_out')") is None


async def test_a_middleware_that_never_calls_next_leaves_the_message_processed_unhandled(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("mw_stop")
    ran: list[int] = []

    @bus.middleware
    async def skip_odd(msg: Message, ctx: Context, call_next: CallNext) -> None:
        if isinstance(msg, Job) and msg.n % 2:
            return
        await call_next()

    @bus.handler
    async def handle(msg: Job, ctx: Context) -> None:
        ran.append(msg.n)

    async with bus:
        for n in (1, 2, 3):
            await bus.send(Job(n=n), to="mw_stop")
        await drain(bus)
    assert ran == [2]
    assert [r["subqueue"] for r in await rows(db, "mw_stop")] == ["X", "X", "X"]


async def test_calling_next_twice_is_refused_and_the_handler_runs_once(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("mw_twice", retry=LATER)
    ran: list[int] = []

    @bus.middleware
    async def twice(msg: Message, ctx: Context, call_next: CallNext) -> None:
        await call_next()
        await call_next()

    @bus.handler
    async def handle(msg: Job, ctx: Context) -> None:
        ran.append(msg.n)

    async with bus:
        await bus.send(Job(n=1), to="mw_twice")
        await drain(bus)
    [row] = await rows(db, "mw_twice")
    assert row["subqueue"] == "R"
    assert row["error_info"].startswith(
        "ConfigurationError: middleware test_calling_next_twice_is_refused_and_the_handler_runs"
        "_once.<locals>.twice called call_next() a second time"
    )
    assert ran == [1]


@pytest.mark.parametrize("replayable", [False, True])
async def test_one_messages_middleware_failure_leaves_its_batch_mates_alone(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, replayable: bool
) -> None:
    """Several messages in one batch (one transaction): the middleware of the third
    fails after its handler wrote; the others' writes and sends are committed.
    With ``outside_effects=False`` the batch runs without savepoints and is run
    again with them (the failure standing)."""
    await make_table(db)
    bus = make_bus("mw_batch", retry=LATER, batch_size=10)

    @bus.middleware
    async def audit(msg: Message, ctx: Context, call_next: CallNext) -> None:
        await ctx.connection.execute("INSERT INTO mw_writes VALUES ('middleware')")
        await call_next()
        if isinstance(msg, Job) and msg.n == 3:
            raise RuntimeError("third is refused")

    @bus.handler(outside_effects=not replayable)
    async def handle(msg: Job, ctx: Context) -> None:
        await ctx.connection.execute("INSERT INTO mw_writes VALUES ('handler')")
        await ctx.send(Done(n=msg.n), to="mw_batch_out")

    sender = make_bus("mw_batch", concurrency=0)
    async with sender:
        for n in range(1, 6):
            await sender.send(Job(n=n), to="mw_batch")
    async with bus:
        await drain(bus)
    got = await rows(db, "mw_batch")
    assert [r["subqueue"] for r in got] == ["X", "X", "R", "X", "X"]
    assert got[2]["error_info"].startswith("RuntimeError: third is refused")
    assert await db.fetchval("SELECT count(*) FROM mw_writes") == 8  # 4 x (middleware, handler)
    sent = [json.loads(r["msg_text"])["n"] for r in await rows(db, "mw_batch_out")]
    assert sent == [1, 2, 4, 5]
    assert bus.worker.replays == (1 if replayable else 0)


async def test_a_handler_timeout_inside_middleware_fails_the_message_and_unwinds_it(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("mw_timeout", retry=LATER)
    unwound: list[str] = []

    @bus.middleware
    async def watch(msg: Message, ctx: Context, call_next: CallNext) -> None:
        try:
            await call_next()
        except BaseException as exc:
            unwound.append(type(exc).__name__)
            raise

    @bus.handler(timeout=0.2)
    async def slow(msg: Job, ctx: Context) -> None:
        await asyncio.sleep(30)

    async with bus:
        await bus.send(Job(n=1), to="mw_timeout")
        await drain(bus)
    [row] = await rows(db, "mw_timeout")
    assert row["subqueue"] == "R"
    assert row["error_info"].startswith("HandlerTimeout: the handler did not finish")
    assert unwound == ["TimeoutError"]


async def test_a_middleware_that_hangs_is_bounded_by_the_timeouts(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("mw_hang", retry=LATER, handler_timeout=0.3)

    @bus.middleware
    async def hang(msg: Message, ctx: Context, call_next: CallNext) -> None:
        await call_next()
        await asyncio.sleep(3600)

    @bus.handler(timeout=0.3)
    async def quick(msg: Job, ctx: Context) -> None:
        pass

    async with bus:
        await bus.send(Job(n=1), to="mw_hang")
        await drain(bus)
    [row] = await rows(db, "mw_hang")
    assert row["subqueue"] == "R"
    assert row["error_info"].startswith("HandlerTimeout")


class Tab(BaseModel):
    total: int = 0


async def test_a_saga_handler_inside_a_failing_middleware_saves_no_state(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("mw_saga", retry=LATER)
    saga = bus.saga(Tab, key="n")

    @bus.middleware
    async def refuse_big(msg: Message, ctx: Context, call_next: CallNext) -> None:
        await call_next()
        if isinstance(msg, Job) and msg.n > 100:
            raise PermissionError("too big")

    @saga.handler(start=True)
    async def add(msg: Job, state: Tab, ctx: Context) -> None:
        state.total += msg.n

    async with bus:
        await bus.send(Job(n=7), to="mw_saga")
        await bus.send(Job(n=700), to="mw_saga")
        await drain(bus)
        assert await saga.load(7) == Tab(total=7)
        assert await saga.load(700) is None
    got = await rows(db, "mw_saga")
    assert [r["subqueue"] for r in got] == ["X", "R"]
    assert got[1]["error_info"].startswith("PermissionError: too big")


# -- outgoing hooks --------------------------------------------------------------------


async def test_an_outgoing_hook_stamps_every_kind_of_outgoing_message(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    """Sends, publishes, requests, replies, saga timeouts and handlers' sends and
    publishes all pass the hooks (in order), which never see nmbus's own headers."""
    front = make_bus("mw_front")
    back = make_bus("mw_back")
    seen: list[tuple[str, str, list[str]]] = []
    for bus in (front, back):

        def register(bus: Bus) -> None:
            @bus.outgoing
            async def stamp(msg: Message, headers: dict[str, str], call_next: CallNext) -> None:
                seen.append((bus.endpoint, msg.__type_name__, sorted(headers)))
                headers.setdefault("tenant", TENANT.get() or "none")
                await call_next()

            @bus.outgoing
            async def second(msg: Message, headers: dict[str, str], call_next: CallNext) -> None:
                headers["stamped"] = headers["tenant"] + "!"
                await call_next()

        register(bus)
    saga = back.saga(Tab, key="n")

    @back.handler
    async def answer(msg: Ask, ctx: Context) -> None:
        await ctx.reply(Answer(n=msg.n))

    @saga.handler(start=True)
    async def start(msg: Job, state: Tab, ctx: Context) -> None:
        await ctx.saga.timeout(3600, Done(n=msg.n))
        await ctx.send(Done(n=msg.n), to="mw_sink")
        await ctx.publish(Done(n=msg.n))

    async with front, back:
        token = TENANT.set("acme")
        try:
            reply = await front.request(Ask(n=1), to="mw_back", timeout=10.0)
            await front.send(Job(n=2), to="mw_back")
            await front.publish(Answer(n=3))
            await front.publish_many([Answer(n=4)])
        finally:
            TENANT.reset(token)
        await drain(back)
        await drain(front)
    assert reply == Answer(n=1)
    kinds = [(e, t) for e, t, _ in seen]
    assert kinds == [
        ("mw_front", "test.mw.Ask"),
        ("mw_back", "test.mw.Answer"),  # the reply, while the request waits
        ("mw_front", "test.mw.Job"),
        ("mw_front", "test.mw.Answer"),
        ("mw_front", "test.mw.Answer"),
        ("mw_back", "test.mw.Done"),  # the saga's timeout
        ("mw_back", "test.mw.Done"),  # a handler's send
        ("mw_back", "test.mw.Done"),  # a handler's publish
    ]
    assert all(not h.startswith("nmbus-") for _, _, headers in seen for h in headers)
    # What the back end sent carries the tenant that travelled with the handled message.
    for queue in ("mw_back", "mw_front", "mw_sink"):
        for r in await db.fetch(f'SELECT msg_headers FROM nmbus."{queue}"'):
            headers = json.loads(r["msg_headers"])
            assert headers["tenant"] == "acme" and headers["stamped"] == "acme!", (queue, headers)
    timeout = await db.fetchrow("SELECT msg_headers FROM nmbus.mw_back WHERE subqueue = 'R'")
    assert json.loads(timeout["msg_headers"])["nmbus-saga"] == "Tab"


async def test_an_outgoing_hook_refuses_and_cannot_touch_nmbus_headers(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("mw_refuse", concurrency=0)
    mode: list[str] = ["stop"]

    @bus.outgoing
    async def gate(msg: Message, headers: dict[str, str], call_next: CallNext) -> None:
        if mode[0] == "stop":
            return
        if mode[0] == "raise":
            raise InvalidMessage("no tenant")
        if mode[0] == "internal":
            headers["nmbus-reply-to"] = "elsewhere"
        if mode[0] == "number":
            headers["n"] = 1  # type: ignore[assignment]
        await call_next()

    async with bus:
        with pytest.raises(InvalidMessage, match="gate did not call call_next"):
            await bus.send(Job(n=1), to="mw_refuse")
        with pytest.raises(InvalidMessage, match="gate did not call call_next"):
            await bus.publish(Job(n=1))
        mode[0] = "raise"
        with pytest.raises(InvalidMessage, match="no tenant"):
            await bus.send(Job(n=1), to="mw_refuse")
        mode[0] = "internal"
        with pytest.raises(InvalidMessage, match="may not set nmbus's own headers"):
            await bus.send(Job(n=1), to="mw_refuse", reply_to="mw_other")
        mode[0] = "number"
        with pytest.raises(InvalidMessage, match="str to str"):
            await bus.send(Job(n=1), to="mw_refuse")
        assert await db.fetchval("SELECT count(*) FROM nmbus.mw_refuse") == 0
        mode[0] = "pass"
        await bus.send(Job(n=1), to="mw_refuse", reply_to="mw_other")
    [row] = await db.fetch("SELECT msg_headers FROM nmbus.mw_refuse")
    assert json.loads(row["msg_headers"]) == {"nmbus-reply-to": "mw_other"}


async def test_a_send_a_hook_stamped_in_a_handler_that_fails_is_never_stored(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("mw_rollback", retry=LATER)
    stamped: list[int] = []

    @bus.outgoing
    async def stamp(msg: Message, headers: dict[str, str], call_next: CallNext) -> None:
        headers["seen"] = "yes"
        await call_next()
        stamped.append(getattr(msg, "n", -1))

    @bus.handler
    async def handle(msg: Job, ctx: Context) -> None:
        await ctx.send(Done(n=msg.n), to="mw_rollback_out")
        if msg.n == 2:
            raise RuntimeError("after sending")

    async with bus:
        await bus.send(Job(n=1), to="mw_rollback")
        await bus.send(Job(n=2), to="mw_rollback")
        await drain(bus)
    assert stamped == [1, 2, 1, 2]  # the two sends to the endpoint, then each handler's
    out = [json.loads(r["msg_text"])["n"] for r in await rows(db, "mw_rollback_out")]
    assert out == [1]
    got = await rows(db, "mw_rollback")
    assert [r["subqueue"] for r in got] == ["X", "R"]


async def test_handlers_running_at_once_each_see_their_own_messages_context(
    make_bus: Callable[..., Bus],
) -> None:
    """With handler_concurrency, handlers of one batch interleave: each sees the
    context variable its own message's middleware set, never a batch-mate's."""
    bus = make_bus("mw_concurrent", handler_concurrency=4, batch_size=8)
    seen: dict[int, str | None] = {}

    @bus.middleware
    async def tenant(msg: Message, ctx: Context, call_next: CallNext) -> None:
        token = TENANT.set(ctx.headers.get("tenant"))
        try:
            await call_next()
        finally:
            TENANT.reset(token)

    @bus.handler
    async def slow(msg: Job, ctx: Context) -> None:
        await asyncio.sleep(0.05 * (8 - msg.n))  # the first started finish last
        seen[msg.n] = TENANT.get()

    sender = make_bus("mw_concurrent", concurrency=0)
    async with sender:
        for n in range(8):
            await sender.send(Job(n=n), to="mw_concurrent", headers={"tenant": f"t{n}"})
    async with bus:
        await drain(bus)
    assert seen == {n: f"t{n}" for n in range(8)}
