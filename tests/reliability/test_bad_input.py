"""The bad input catalogue: each case gets a clear error and no worker stops."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import asyncpg
import pydantic
import pytest

from nmbus import (
    Bus,
    Context,
    InvalidMessage,
    InvalidQueueName,
    Message,
    MessageTooLarge,
    RetryLater,
    RetryPolicy,
    Settings,
)
from nmbus.testing import drain
from tests.messages import Ping, Pong
from tests.waits import wait_until

pytestmark = pytest.mark.reliability


class Blob(Message, type_name="test.reliability.Blob"):
    data: str


class Note(Message, type_name="test.reliability.Note"):
    text: str
    retry_in: float = 0.0


RAW = (
    "INSERT INTO nmbus.billing (from_endpoint, to_endpoint, label, msg_text, unique_id) "
    "VALUES ('outside', 'billing', $1, $2, $3)"
)


def assert_workers_alive(bus: Bus) -> None:
    tasks = bus.worker._tasks
    assert tasks and not any(t.done() for t in tasks)


async def test_undecodable_bodies_go_to_f_with_a_clear_reason(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", concurrency=2, batch_size=5)
    seen: list[int] = []

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)

    async with bus:
        cases = {
            "not-json": ("test.Ping", "{not json"),
            "empty": ("test.Ping", ""),
            "null-body": ("test.Ping", None),
            "array": ("test.Ping", "[1, 2]"),
            "wrong-schema": ("test.Ping", '{"m": 1}'),
            "wrong-type": ("test.Ping", '{"n": "many"}'),
            "unknown-type": ("no.Such.Type", '{"n": 1}'),
            "no-label": (None, '{"n": 1}'),
            "no-handler": ("test.Pong", '{"n": 1}'),
            "binary": ("test.Ping", "\u00ff\u00fe\x01\x02"),
            "huge-garbage": ("test.Ping", "{" + "x" * 10_000_000),
        }
        for uid, (label, body) in cases.items():
            await db.execute(RAW, label, body, uid)
        await bus.send(Ping(n=1), to="billing")
        await drain(bus, timeout=60)
        assert_workers_alive(bus)
        await bus.send(Ping(n=2), to="billing")  # still working afterwards
        await drain(bus, timeout=30)
        assert_workers_alive(bus)
    result = {
        r["unique_id"]: (r["subqueue"], r["error_info"] or "")
        for r in await db.fetch("SELECT unique_id, subqueue, error_info FROM nmbus.billing")
    }
    expected_prefix = {
        "not-json": "UndecodableMessage: body is not a valid test.Ping",
        "empty": "UndecodableMessage",
        "null-body": "UndecodableMessage",
        "array": "UndecodableMessage",
        "wrong-schema": "UndecodableMessage",
        "wrong-type": "UndecodableMessage",
        "unknown-type": "UnknownMessageType: no message type 'no.Such.Type'",
        "no-label": "UnknownMessageType",
        "no-handler": "NoHandler: endpoint 'billing' has no handler for 'test.Pong'",
        "binary": "UndecodableMessage",
        "huge-garbage": "UndecodableMessage",
    }
    for uid, prefix in expected_prefix.items():
        subqueue, info = result[uid]
        assert subqueue == "F", uid
        assert info.startswith(prefix), (uid, info[:200])
        assert len(info) <= 8000, uid
    assert "Field required" in result["wrong-schema"][1]
    assert "valid integer" in result["wrong-type"][1]
    assert sorted(seen) == [1, 2]


async def test_a_10_mb_body_is_refused_at_send_unless_the_limit_allows_it(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    big = Blob(data="é" * 5_000_000)  # 10 MB as UTF-8
    async with make_bus("orders", concurrency=0) as sender:
        with pytest.raises(MessageTooLarge, match="over the limit of 1048576"):
            await sender.send(big, to="billing")
    assert await db.fetchval("SELECT to_regclass('nmbus.billing')") is None

    bus = make_bus("billing", max_message_bytes=20_000_000)
    sizes: list[int] = []

    @bus.handler
    async def on_blob(msg: Blob, ctx: Context) -> None:
        sizes.append(len(msg.data))

    async with bus:
        await bus.send(big, to="billing")
        await drain(bus, timeout=60)
    assert sizes == [5_000_000]
    assert await db.fetchval("SELECT subqueue FROM nmbus.billing") == "X"


@pytest.mark.parametrize(
    "name",
    [
        'bil"ling',
        "bil'ling",
        "bil ling",
        " billing",
        "billing; DROP TABLE nmbus.queues; --",
        'x"; DROP SCHEMA nmbus CASCADE; --',
        "a" * 200,
        "",
        "1starts_with_digit",
        "new\nline",
        "nul\x00char",
        "queues",
    ],
)
async def test_hostile_queue_names_are_refused_everywhere(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, name: str
) -> None:
    with pytest.raises(InvalidQueueName):
        make_bus(name)
    bus = make_bus("orders", concurrency=0)
    with pytest.raises(InvalidQueueName):
        bus.subscribe(Ping, publisher=name)
    async with bus:
        with pytest.raises(InvalidQueueName, match=r"invalid queue name|reserved"):
            await bus.send(Ping(n=1), to=name)
        with pytest.raises(InvalidQueueName):
            await bus.store.ensure_queue(name)
        await bus.send(Ping(n=2), to="fine.name-1")
    tables = {
        r[0] for r in await db.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'nmbus'")
    }
    assert tables == {
        "schema_version",
        "queues",
        "subscriptions",
        "outbox",
        "periodic$due",
        "flow$flights",
        "flow$limits",
        "claim$payloads",
        *(
            f"{queue}{part}"
            for queue in ("orders", "fine.name-1")
            for part in ("", "$s0", "$s1", "$unique")
        ),
    }


async def test_odd_headers_round_trip_or_are_refused_at_send(
    make_bus: Callable[..., Bus],
) -> None:
    bus = make_bus("billing")
    got: list[dict[str, str]] = []

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        got.append(dict(ctx.headers))

    odd = {
        "quote\"'`": "va\"l'ue`",
        "emoji 🚌": "😀 ü ß 中文",
        "new\nline": "tab\tand\r\nreturn",
        "back\\slash": "\\u0000 (not a NUL: escaped text)",
        "sql": "'); DROP TABLE nmbus.billing; --",
        "empty": "",
        "long": "h" * 10_000,
        "{json}": '{"nested": [1, 2]}',
    }
    async with bus:
        await bus.send(Ping(n=1), to="billing", headers=odd)
        with pytest.raises(ValueError, match="NUL"):
            await bus.send(Ping(n=2), to="billing", headers={"k": "nul\x00value"})
        with pytest.raises(ValueError, match="NUL"):
            await bus.send(Ping(n=3), to="billing", headers={"nul\x00key": "v"})
        with pytest.raises(InvalidMessage, match="headers must map str to str"):
            await bus.send(Ping(n=4), to="billing", headers={"n": 1})  # type: ignore[dict-item]
        await drain(bus)
        assert_workers_alive(bus)
    assert got == [odd]


async def test_deliver_at_far_past_far_future_and_negative_delays(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", max_attempts=2, retry_delay=0.1)
    handled: list[str] = []

    @bus.handler
    async def on_note(msg: Note, ctx: Context) -> None:
        handled.append(msg.text)
        if msg.retry_in:
            raise RetryLater(seconds=msg.retry_in)

    async with bus:
        await bus.send(Note(text="past"), to="billing", deliver_at=datetime(1, 1, 1, tzinfo=UTC))
        await bus.send(
            Note(text="epoch"), to="billing", deliver_at=datetime(1970, 1, 1, tzinfo=UTC)
        )
        await bus.send(
            Note(text="future"), to="billing", deliver_at=datetime(9999, 12, 31, tzinfo=UTC)
        )
        await bus.send(Note(text="zero"), to="billing", delay=0)
        with pytest.raises(ValueError, match="delay must be >= 0"):
            await bus.send(Note(text="negative"), to="billing", delay=-5)
        with pytest.raises(ValueError, match="timezone-aware"):
            await bus.send(Note(text="naive"), to="billing", deliver_at=datetime(2000, 1, 1))
        with pytest.raises(ValueError, match="not both"):
            await bus.send(Note(text="both"), to="billing", delay=1, deliver_at=datetime.now(UTC))
        # A handler asking for a negative retry delay fails with a clear error.
        await bus.send(Note(text="retry-negative", retry_in=-1), to="billing")
        await drain(bus, timeout=20)
        await wait_until(
            "SELECT count(*) FROM nmbus.billing WHERE subqueue = 'F'", db=db, timeout=20
        )
        assert_workers_alive(bus)
    rows = {r["msg_text"]: r for r in await db.fetch("SELECT * FROM nmbus.billing ORDER BY id")}
    by_text = {Note.model_validate_json(k).text: v for k, v in rows.items()}
    assert set(by_text) == {"past", "epoch", "future", "zero", "retry-negative"}
    for text in ("past", "epoch", "zero"):
        assert by_text[text]["subqueue"] == "X"
    future = by_text["future"]
    assert future["subqueue"] == "R" and future["retry_count"] == 0
    assert future["retry_time"] > datetime.now(UTC) + timedelta(days=365 * 7000)
    negative = by_text["retry-negative"]
    assert negative["subqueue"] == "F"
    assert negative["error_info"].startswith("InvalidSetting: RetryLater needs seconds >= 0")
    assert sorted(handled) == ["epoch", "past", "retry-negative", "retry-negative", "zero"]

    with pytest.raises(ValueError, match="retry delays must be >= 0"):
        RetryPolicy(initial_delay=-1)
    with pytest.raises(pydantic.ValidationError):
        Settings(retry_delay=-1)
    with pytest.raises(ValueError, match="RetryLater needs seconds >= 0"):
        RetryLater(seconds=-0.5)


async def test_a_pong_without_handler_does_not_block_a_batch(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", batch_size=50)
    seen: list[int] = []

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)

    async with bus, make_bus("orders", concurrency=0) as sender:
        for n in range(40):
            await sender.send(Pong(n=n) if n % 4 == 0 else Ping(n=n), to="billing")
        await drain(bus)
        assert_workers_alive(bus)
    assert len(seen) == 30
    counts = dict(await db.fetch("SELECT subqueue, count(*) FROM nmbus.billing GROUP BY 1"))
    assert counts == {"X": 30, "F": 10}
