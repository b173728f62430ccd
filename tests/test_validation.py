"""Values that would break at run time are refused where they enter (issue 11).

Settings, retry policies and delays must be finite and within what PostgreSQL
intervals hold (defect 7); a message its receiver could not read is never
stored (defect 8); headers and ids that PostgreSQL cannot store fail the
handler that sent them, not its batch (defect 3); ``reconnect_max_delay``
reaches the listener.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any, cast

import asyncpg
import pytest
import structlog.testing
from pydantic import BaseModel, Field

from nmbus import Bus, Context, Message, RetryLater, RetryPolicy, Settings
from nmbus import settings as settings_module
from nmbus.errors import (
    MAX_SECONDS,
    HandlerError,
    InvalidMessage,
    InvalidSetting,
    MessageTooLarge,
)
from nmbus.settings import build_settings
from nmbus.testing import MemoryStore, drain
from tests.messages import Event, Ping, Pong
from tests.saga_workers import Counter
from tests.waits import wait_until

INF = float("inf")
NAN = float("nan")


def memory_bus(endpoint: str = "billing", **settings: Any) -> Bus:
    return Bus(endpoint, store=MemoryStore(), **{"poll_interval": 0.05, **settings})


# -- defect 7: settings, policies and delays -------------------------------------------


BAD_SETTINGS = [
    ("lease_seconds", INF),
    ("lease_seconds", NAN),
    ("lease_seconds", 1e12),
    ("retry_delay", INF),
    ("retry_delay", NAN),
    ("retry_max_delay", INF),
    ("retry_max_delay", NAN),
    ("subscription_ttl", INF),
    ("subscription_ttl", NAN),
    ("poll_interval", INF),
    ("poll_interval", NAN),
    ("handler_timeout", INF),
    ("handler_timeout", NAN),
    ("shutdown_timeout", INF),
    ("shutdown_timeout", NAN),
    ("reconnect_max_delay", INF),
    ("reconnect_max_delay", NAN),
    ("retention_interval", INF),
    ("retention_interval", NAN),
    ("retention_max_age", timedelta(days=-1)),
    ("retention_max_age", timedelta(days=999_999_999)),
    ("retention_failed_max_age", timedelta(seconds=-1)),
    ("retention_failed_max_age", timedelta(days=365 * 11)),
]


@pytest.mark.parametrize(("name", "value"), BAD_SETTINGS)
def test_a_setting_that_breaks_at_run_time_is_refused_by_bus(name: str, value: Any) -> None:
    with pytest.raises(InvalidSetting, match=name) as raised:
        memory_bus(**{name: value})
    message = str(raised.value)
    assert "\n" not in message
    assert f"NMBUS_{name.upper()}" in message


@pytest.mark.parametrize(("name", "value"), BAD_SETTINGS)
def test_a_bad_setting_is_refused_as_an_override_of_given_settings(name: str, value: Any) -> None:
    with pytest.raises(InvalidSetting, match=name):
        Bus("billing", settings=Settings(), store=MemoryStore(), **{name: value})


@pytest.mark.parametrize(("name", "value"), BAD_SETTINGS)
def test_settings_themselves_refuse_the_value(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=name):
        Settings(**{name: value})


@pytest.mark.parametrize("value", ["inf", "nan", "1e12"])
def test_a_bad_setting_from_the_environment_is_refused(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NMBUS_LEASE_SECONDS", value)
    with pytest.raises(InvalidSetting, match="NMBUS_LEASE_SECONDS"):
        memory_bus()


def test_the_longest_values_nmbus_accepts_still_work() -> None:
    bus = memory_bus(
        lease_seconds=MAX_SECONDS,
        retry_delay=MAX_SECONDS,
        retry_max_delay=MAX_SECONDS,
        retention_max_age=timedelta(seconds=MAX_SECONDS),
        retention_failed_max_age=timedelta(0),
    )
    assert bus.settings.lease_seconds == MAX_SECONDS


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_delay": INF},
        {"initial_delay": NAN},
        {"initial_delay": 1e12},
        {"backoff": INF},
        {"backoff": NAN},
        {"max_delay": INF},
        {"max_delay": NAN},
        {"max_delay": 1e12},
        {"jitter": NAN},
    ],
)
def test_a_retry_policy_that_breaks_at_run_time_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidSetting, match=next(iter(kwargs))):
        RetryPolicy(**kwargs)


def test_retry_delays_never_overflow() -> None:
    policy = RetryPolicy(max_attempts=100_000, initial_delay=1, backoff=1e300, jitter=0)
    assert policy.delay(50_000) == policy.max_delay
    slow = RetryPolicy(max_attempts=100_000, initial_delay=0.5, backoff=2, max_delay=60)
    assert 0 < slow.delay(5_000) <= 66
    assert RetryPolicy(initial_delay=0, backoff=1e300, jitter=0).delay(10) == 0


@pytest.mark.parametrize("seconds", [INF, -INF, NAN, 1e12, MAX_SECONDS + 1, -1])
def test_retry_later_refuses_delays_that_cannot_be_stored(seconds: float) -> None:
    with pytest.raises(InvalidSetting, match="RetryLater") as raised:
        RetryLater(seconds)
    assert "\n" not in str(raised.value)


def test_retry_later_accepts_up_to_ten_years() -> None:
    assert RetryLater(MAX_SECONDS).seconds == MAX_SECONDS
    assert RetryLater(0).seconds == 0


@pytest.mark.parametrize("timeout", [INF, NAN, 1e12])
def test_a_handler_timeout_that_cannot_work_is_refused(timeout: float) -> None:
    bus = memory_bus()
    with pytest.raises(HandlerError, match="timeout"):

        @bus.handler(timeout=timeout)
        async def handle(msg: Ping, ctx: Context) -> None: ...


@pytest.mark.parametrize("delay", [INF, NAN, 1e12])
async def test_a_send_delay_that_cannot_be_stored_is_refused(delay: float) -> None:
    async with memory_bus(concurrency=0) as bus:
        with pytest.raises(InvalidMessage, match="delay"):
            await bus.send(Ping(n=1), to="billing", delay=delay)


async def test_retry_later_inf_in_a_handler_fails_that_attempt_with_the_real_error(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", batch_size=10, max_attempts=2, retry_delay=30)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        if msg.n == 3:
            raise RetryLater(INF)

    async with bus:
        for n in range(1, 6):
            await bus.send(Ping(n=n), to="billing")
        await drain(bus)
    rows = await db.fetch("SELECT msg_text, subqueue, retry_count, error_info FROM nmbus.billing")
    outcome = {r["msg_text"]: r for r in rows}
    poison = outcome['{"n":3}']
    assert poison["subqueue"] == "R" and poison["retry_count"] == 1
    assert poison["error_info"].startswith("InvalidSetting: RetryLater"), poison["error_info"]
    assert sorted(r["subqueue"] for r in rows) == ["R", "X", "X", "X", "X"]


# -- defect 8: floats that JSON cannot carry -----------------------------------------


class Price(Message, type_name="test.validation.Price"):
    amount: float


class Line(BaseModel):
    price: float


class Order(Message, type_name="test.validation.Order"):
    lines: list[Line]
    rates: dict[str, float] = Field(default_factory=dict)
    note: str | None = None


@pytest.mark.parametrize(
    ("message", "where"),
    [
        (Price(amount=INF), "amount"),
        (Price(amount=-INF), "amount"),
        (Price(amount=NAN), "amount"),
        (Order(lines=[Line(price=1.0), Line(price=INF)]), "lines"),
        (Order(lines=[], rates={"eur": NAN}), "rates"),
    ],
)
async def test_send_refuses_a_float_its_receiver_could_not_read(
    message: Message, where: str
) -> None:
    async with memory_bus(concurrency=0) as bus:
        with pytest.raises(InvalidMessage, match=where) as raised:
            await bus.send(message, to="billing")
        with pytest.raises(InvalidMessage):
            await bus.publish(message)
        assert isinstance(bus.store, MemoryStore)
        assert bus.store.tables.get("billing", {}) == {}
    assert "\n" not in str(raised.value)


async def test_finite_floats_and_look_alike_text_are_sent(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    sent: list[Message] = [
        Price(amount=1e308),
        Event(name="NaN, Infinity and null"),
        Order(lines=[Line(price=-0.0)], rates={"NaN": 1.5}),
    ]
    received: list[Message] = []
    bus = make_bus("billing", poll_interval=0.2)

    @bus.handler
    async def on_any(msg: Message, ctx: Context) -> None:  # every type, by the class chain
        received.append(msg)

    async with bus:
        for message in sent:
            await bus.send(message, to="billing")
        await drain(bus)
    rows = await db.fetch("SELECT label, subqueue, msg_text FROM nmbus.billing ORDER BY id")
    # Stored as sent, as JSON PostgreSQL accepts, and handled as equal messages.
    assert [(r["label"], r["subqueue"]) for r in rows] == [
        (type(m).__type_name__, "X") for m in sent
    ]
    assert [json.loads(r["msg_text"]) for r in rows] == [
        {"amount": 1e308},
        {"name": "NaN, Infinity and null"},
        {"lines": [{"price": -0.0}], "rates": {"NaN": 1.5}, "note": None},
    ]
    assert received == sent
    assert math.copysign(1.0, cast(Order, received[2]).lines[0].price) == -1.0  # -0.0 kept


async def test_a_handler_sending_an_unreadable_float_fails_with_the_real_error(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", batch_size=10, max_attempts=1)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        if msg.n == 3:
            await ctx.send(Price(amount=INF), to="audit")
        elif msg.n == 4:
            await ctx.publish(Price(amount=NAN))
        else:
            await ctx.send(Pong(n=msg.n), to="audit")

    async with bus:
        for n in range(1, 7):
            await bus.send(Ping(n=n), to="billing")
        await drain(bus)
    rows = await db.fetch("SELECT msg_text, subqueue, error_info FROM nmbus.billing ORDER BY id")
    assert [r["subqueue"] for r in rows] == ["X", "X", "F", "F", "X", "X"]
    for failed in rows[2:4]:
        assert failed["error_info"].startswith("InvalidMessage: "), failed["error_info"]
        assert "amount" in failed["error_info"].splitlines()[0]
    sent = await db.fetch("SELECT label, msg_text FROM nmbus.audit ORDER BY id")
    assert [r["msg_text"] for r in sent] == ['{"n":1}', '{"n":2}', '{"n":5}', '{"n":6}']


# -- defect 3 (part): headers and ids PostgreSQL cannot store ---------------------------

BAD_SENDS: list[dict[str, Any]] = [
    {"headers": {"x": "\ud800"}},
    {"headers": {"\udfff": "v"}},
    {"headers": {"x": "a\x00b"}},
    {"headers": {"a\x00": "v"}},
    {"unique_id": "\ud800"},
    {"unique_id": "id\x00"},
]


@pytest.mark.parametrize("kwargs", BAD_SENDS)
async def test_send_refuses_headers_and_ids_postgresql_cannot_store(
    kwargs: dict[str, Any],
) -> None:
    async with memory_bus(concurrency=0) as bus:
        with pytest.raises(InvalidMessage) as raised:
            await bus.send(Ping(n=1), to="billing", **kwargs)
        with pytest.raises(InvalidMessage):
            await bus.publish(Ping(n=1), **kwargs)
    assert "\n" not in str(raised.value)


async def test_send_refuses_a_correlation_id_postgresql_cannot_store() -> None:
    async with memory_bus(concurrency=0) as bus:
        for bad in ("\ud800", "c\x00"):
            with pytest.raises(InvalidMessage, match="correlation_id"):
                await bus.send(Ping(n=1), to="billing", correlation_id=bad)


@pytest.mark.parametrize("kwargs", BAD_SENDS)
async def test_a_handler_sending_bad_headers_fails_alone_with_the_real_error(
    kwargs: dict[str, Any], make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", batch_size=10, max_attempts=2, retry_delay=30)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        await ctx.send(Pong(n=msg.n), to="audit", **(kwargs if msg.n == 3 else {}))

    async with bus:
        for n in range(1, 6):
            await bus.send(Ping(n=n), to="billing")
        await asyncio.wait_for(drain(bus), 10)
    rows = await db.fetch(
        "SELECT msg_text, subqueue, retry_count, error_info FROM nmbus.billing ORDER BY id"
    )
    assert [r["subqueue"] for r in rows] == ["X", "X", "R", "X", "X"]
    poison = rows[2]
    assert poison["retry_count"] == 1
    assert poison["error_info"].startswith("InvalidMessage: "), poison["error_info"]
    sent = await db.fetch("SELECT msg_text FROM nmbus.audit ORDER BY id")
    assert [r["msg_text"] for r in sent] == ['{"n":1}', '{"n":2}', '{"n":4}', '{"n":5}']


# -- reconnect_max_delay reaches the listener ------------------------------------------


async def test_reconnect_max_delay_reaches_the_listener(make_bus: Callable[..., Bus]) -> None:
    bus = make_bus("billing", reconnect_max_delay=0.7)
    given: list[float] = []
    listen = bus.store.listen

    async def spy(on_wakeup: Callable[[str], None], *args: Any, **kwargs: Any) -> None:
        given.extend(args)
        given.extend(kwargs.values())
        await listen(on_wakeup, *args, **kwargs)

    bus.store.listen = spy  # type: ignore[method-assign]
    async with bus:
        await wait_until(lambda: given, what="the listener started")
    assert given == [0.7]


# -- issue 23, defect 9: nmbus's own headers cannot be forged ------------------------

FORGED = ["nmbus-in-reply-to", "nmbus-requester", "NMBUS-Reply-By", "Nmbus-Saga-Key", "nmbus-x"]


@pytest.mark.parametrize("name", FORGED)
async def test_send_publish_and_request_refuse_nmbus_header_names(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, name: str
) -> None:
    """A forged requester and a reply-by of year 9999 made a message bounce in R for ever."""
    forged = {"tenant": "t1", name: "9999-12-31T00:00:00+00:00"}
    bus = make_bus("billing", subscription_ttl=None)
    bus.subscribe(Ping, "billing")
    async with bus:
        with pytest.raises(InvalidMessage, match="reserved"):
            await bus.send(Ping(n=1), to="billing", headers=forged)
        with pytest.raises(InvalidMessage, match="reserved"):
            await bus.publish(Ping(n=2), headers=forged)
        with pytest.raises(InvalidMessage, match="reserved"):
            await bus.publish_many([Ping(n=3)], headers=forged)
        with pytest.raises(InvalidMessage, match="reserved"):
            await bus.request(Ping(n=4), to="billing", headers=forged, timeout=1)
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing") == 0


async def test_handlers_cannot_forge_nmbus_headers_but_replies_still_carry_them(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", poll_interval=0.2, max_attempts=1)
    refused: list[str] = []

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        forged = {"nmbus-requester": "someone:1:else"}
        for attempt in (
            lambda: ctx.send(Pong(n=msg.n), to="billing", headers=forged),
            lambda: ctx.publish(Pong(n=msg.n), headers=forged),
            lambda: ctx.reply(Pong(n=msg.n), headers=forged),
        ):
            try:
                await attempt()
            except InvalidMessage as exc:
                refused.append(str(exc))
        await ctx.reply(Pong(n=msg.n), headers={"tenant": "t1"})

    @bus.handler
    async def on_pong(msg: Pong, ctx: Context) -> None: ...

    async with bus:
        answer = await bus.request(Ping(n=7), to="billing", timeout=20)
    assert answer == Pong(n=7)
    assert len(refused) == 3 and all("reserved" in text for text in refused)
    reply = await db.fetchrow(
        "SELECT msg_headers FROM nmbus.billing WHERE label = $1", Pong.__type_name__
    )
    headers = json.loads(reply["msg_headers"])
    assert headers["tenant"] == "t1"
    assert headers["nmbus-requester"] == bus.client_id  # set by nmbus, not forged


# -- issue 23, defect 11: unbounded input ---------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({"headers": {"h": "x" * 20_000_000}}, MessageTooLarge, "headers"),
        ({"headers": {"h": "é" * 600_000}}, MessageTooLarge, "over the limit of 1048576"),
        ({"unique_id": "u" * 3000}, InvalidMessage, "unique_id is 3000 bytes"),
        ({"unique_id": "🗝" * 251}, InvalidMessage, "unique_id is 1004 bytes"),
        ({"correlation_id": "c" * 3000}, InvalidMessage, "correlation_id is 3000 bytes"),
        (
            {"correlation_id": 123},
            InvalidMessage,
            "correlation_id must be a non-empty string, got int",
        ),
        ({"unique_id": 123}, InvalidMessage, "unique_id must be a non-empty string, got int"),
        ({"headers": [("a", "b")]}, InvalidMessage, "mapping of str to str"),
        ({"headers": "a=b"}, InvalidMessage, "mapping of str to str"),
        ({"headers": {"n": 1}}, InvalidMessage, "headers must map str to str"),
        ({"connection": object()}, InvalidMessage, "asyncpg connection"),
        ({"sequence": "🗝" * 60}, InvalidMessage, "sequence key is 240 bytes"),
        ({"delay": "5"}, InvalidMessage, "delay must be a number"),
        ({"deliver_at": "2030-01-01"}, InvalidMessage, "deliver_at must be a timezone-aware"),
    ],
)
async def test_unbounded_or_mistyped_send_arguments_are_refused_at_send(
    make_bus: Callable[..., Bus],
    db: asyncpg.Connection,
    kwargs: dict[str, Any],
    error: type[Exception],
    says: str,
) -> None:
    """A 20 MB header was stored and copied on every hop; a 3,000-character unique_id
    failed with a driver error; correlation_id=123, headers=[...] and connection=object()
    gave TypeError or AttributeError."""
    bus = make_bus("billing", concurrency=0, subscription_ttl=None)
    bus.subscribe(Ping, "billing")
    async with bus:
        with pytest.raises(error, match=says):
            await bus.send(Ping(n=1), to="billing", **kwargs)
        with pytest.raises(error):
            await bus.publish(Ping(n=2), **kwargs)
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing") == 0


async def test_keys_up_to_the_byte_limit_are_stored(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", concurrency=0, subscription_ttl=None)
    bus.subscribe(Ping, "billing")
    longest = "🗝" * 250  # 1,000 bytes
    async with bus:
        await bus.send(Ping(n=1), to="billing", unique_id=longest, correlation_id=longest)
        await bus.publish(Ping(n=2), unique_id="p" + longest[1:], sequence="🗝" * 50)
        # A header that keeps body and headers under the limit is fine.
        await bus.send(Ping(n=3), to="billing", headers={"h": "x" * 1_000_000})
    rows = await db.fetch("SELECT unique_id, correlation_id FROM nmbus.billing ORDER BY id")
    assert rows[0]["unique_id"] == longest and rows[0]["correlation_id"] == longest
    assert rows[1]["unique_id"].startswith("p") and rows[1]["unique_id"].endswith("/billing")
    assert len(rows) == 3


class Keyed(Message, type_name="test.validation.Keyed"):
    key: str


async def test_a_saga_key_over_the_index_limit_in_bytes_goes_to_f_at_once(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    """1,000 characters of 4 bytes passed the character limit, then failed every
    attempt with ProgramLimitExceededError."""
    bus = make_bus("keyed", poll_interval=0.2, max_attempts=5)
    saga = bus.saga(Counter, key="key")

    @saga.handler(start=True)
    async def keyed(msg: Keyed, state: Counter, ctx: Context) -> None:
        state.count += 1

    async with bus:
        await bus.send(Keyed(key="🗝" * 1000), to="keyed")
        await bus.send(Keyed(key="🗝" * 250), to="keyed")  # 1,000 bytes: fits
        await drain(bus)
    rows = await db.fetch("SELECT subqueue, retry_count, error_info FROM nmbus.keyed ORDER BY id")
    assert rows[0]["subqueue"] == "F" and rows[0]["retry_count"] == 1  # one attempt
    assert rows[0]["error_info"].startswith(
        "PermanentError: a saga key is at most 1000 bytes as UTF-8, got 4000"
    )
    assert rows[1]["subqueue"] == "X"
    assert await db.fetchval('SELECT count(*) FROM nmbus."keyed$saga"') == 1


# -- issue 23, defect 12: settings the design cannot honour ---------------------------

ABSURD_SETTINGS = [
    ("lease_seconds", 0.005, "at least 1 second"),
    ("lease_seconds", 0, "greater than 0"),
    ("lease_seconds", -1, "greater than 0"),
    ("poll_interval", 0, "greater than or equal to 0.01"),
    ("poll_interval", 1e-9, "greater than or equal to 0.01"),
    ("handler_timeout", 1e-9, "greater than or equal to 0.01"),
    ("subscription_ttl", 0.001, "greater than or equal to 0.5"),
    ("reconnect_max_delay", 0, "greater than or equal to 0.1"),
    ("retention_interval", 0.001, "greater than or equal to 0.1"),
    ("concurrency", 1_000_000, "less than or equal to 1000"),
    ("send_pool_size", 1_000_000, "less than or equal to 1000"),
    ("max_attempts", 10**9, "less than or equal to 1000000"),
    ("max_message_bytes", 0, "greater than or equal to 64"),
    ("max_message_bytes", 10**12, "less than or equal to 268435456"),
    ("shutdown_timeout", -1, "greater than or equal to 0"),
]


@pytest.mark.parametrize(("name", "value", "says"), ABSURD_SETTINGS)
def test_settings_below_what_the_design_honours_are_refused(
    make_bus: Callable[..., Bus], name: str, value: Any, says: str
) -> None:
    """lease_seconds=0.005 was accepted, and a message was handled twice."""
    with pytest.raises(InvalidSetting, match=f"NMBUS_{name.upper()}") as raised:
        make_bus("billing", **{name: value})
    assert says in str(raised.value)
    assert "\n" not in str(raised.value)


async def test_the_shortest_lease_still_works(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", lease_seconds=1.0, poll_interval=0.2)
    handled: list[int] = []

    @bus.handler
    async def slow(msg: Ping, ctx: Context) -> None:
        await asyncio.sleep(1.5)  # over the lease: renewed, never taken over
        handled.append(msg.n)

    rival = make_bus("billing", lease_seconds=1.0, poll_interval=0.1)

    @rival.handler
    async def also(msg: Ping, ctx: Context) -> None:
        handled.append(-msg.n)

    async with bus:
        await bus.send(Ping(n=1), to="billing")
        await wait_until(lambda: handled, timeout=20)
        async with rival:
            await drain(bus)
    assert handled == [1]


def test_a_removed_setting_of_an_old_deployment_is_warned_of_once_and_ignored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Held batches were removed (docs/reliability.md): a deployment that still sets
    # NMBUS_HELD_BATCHES, or passes held_batches=, starts as before, warned once.
    monkeypatch.setattr(settings_module, "_warned", set())
    monkeypatch.setenv("NMBUS_HELD_BATCHES", "true")
    with structlog.testing.capture_logs() as logs:
        first = Settings()
        Settings()
        build_settings(held_batches=True)
        Bus("billing", dsn="postgresql://x@127.0.0.1/none", held_batches=True)
    warned = [e for e in logs if e["event"] == "setting_removed"]
    assert [(e["setting"], e["where"]) for e in warned] == [("held_batches", "NMBUS_HELD_BATCHES")]
    assert "held_batches" not in Settings.model_fields
    assert first == Settings()
