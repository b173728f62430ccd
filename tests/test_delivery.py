"""Priority, expiry and the failure port (docs/delivery.md), on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from nmbus import Bus, Context, InvalidMessage, PermanentError
from nmbus.envelopes import dead_letter_copy
from nmbus.messages import Envelope
from nmbus.postgres import PostgresStore
from nmbus.postgres.segments import advance
from nmbus.testing import MemoryStore, drain
from tests.messages import Ping
from tests.procs import ROOT
from tests.waits import wait_until


async def rows(db: asyncpg.Connection, queue: str = "billing") -> list[asyncpg.Record]:
    return await db.fetch(f'SELECT * FROM nmbus."{queue}" ORDER BY id')


# -- priority ----------------------------------------------------------------------


@pytest.mark.parametrize("store", ["postgres", "memory"])
async def test_a_priority_9_message_sent_last_is_handled_first(
    make_bus: Callable[..., Bus], store: str
) -> None:
    # Built, never started: its worker is stopped while the messages are sent.
    bus = (
        make_bus("billing", batch_size=1)
        if store == "postgres"
        else Bus("billing", store=MemoryStore(), batch_size=1)
    )
    seen: list[int] = []

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)

    await bus.store.open()
    try:
        for n in range(10):
            await bus.send(Ping(n=n), to="billing")
        await bus.send(Ping(n=99), to="billing", priority=9)
        counts = await bus.worker.run_burst()
    finally:
        await bus.store.close()
    assert counts["X"] == 11
    assert seen == [99, *range(10)]


async def _burst(bus: Bus) -> dict[str, int]:
    await bus.store.open()
    try:
        await bus.store.ensure_queue(bus.endpoint)
        return await bus.worker.run_burst()
    finally:
        await bus.store.close()


async def test_priorities_mixed_are_claimed_highest_first_then_in_send_order(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    async with make_bus("billing", concurrency=0) as bus:
        for n, priority in enumerate([0, 5, -3, 5, 100, 0, -100]):
            await bus.send(Ping(n=n), to="billing", priority=priority)
    seen: list[int] = []
    bus = make_bus("billing", batch_size=3)

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)

    await _burst(bus)
    assert seen == [4, 1, 3, 0, 5, 2, 6]


# docs/delivery.md, "Priority does not age", states what these two tests check.
NO_AGEING = "### Priority does not age"


def _ping(n: int, priority: int) -> Envelope:
    return Envelope("test.Ping", json.dumps({"n": n}), None, f"ping-{n}", None, None, priority)


async def test_priority_does_not_age_a_claim_takes_the_low_one_only_below_a_batch(
    dsn: str,
) -> None:
    assert NO_AGEING in (ROOT / "docs" / "delivery.md").read_text()
    store = PostgresStore(dsn)
    await store.open()
    try:
        await store.insert("billing", "me", [_ping(0, 0)])  # the low one, sent first
        n = 1
        async with store.worker_session() as session:
            # A steady stream: every claim finds a batch (3) of higher ones ready.
            for _ in range(20):
                await store.insert("billing", "me", [_ping(n + k, 5) for k in range(3)])
                n += 3
                claimed = [
                    json.loads(m.msg_text)["n"]
                    for m in await session.claim("billing", 3, "w1", 30.0)
                ]
                assert claimed == [n - 3, n - 2, n - 1]  # never the low one
            # The stream thins out: two higher ones ready, fewer than a batch.
            await store.insert("billing", "me", [_ping(n, 5), _ping(n + 1, 5)])
            claimed = [
                json.loads(m.msg_text)["n"] for m in await session.claim("billing", 3, "w1", 30.0)
            ]
            assert claimed == [n, n + 1, 0]
    finally:
        await store.close()


async def test_priority_does_not_age_batch_1_starves_for_as_long_as_the_stream_lasts(
    make_bus: Callable[..., Bus],
) -> None:
    assert NO_AGEING in (ROOT / "docs" / "delivery.md").read_text()
    stream = 30
    bus = make_bus("billing", batch_size=1, concurrency=1)
    seen: list[int] = []

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)
        if 0 < msg.n < stream:  # each higher one sends the next: one is always ready
            await ctx.send(Ping(n=msg.n + 1), to="billing", priority=5)

    async with make_bus("sender", concurrency=0) as sender:
        await sender.send(Ping(n=0), to="billing")  # low (0), sent first
        await sender.send(Ping(n=1), to="billing", priority=5)
    await _burst(bus)
    assert seen == [*range(1, stream + 1), 0]


@pytest.mark.parametrize("priority", [101, -101, 2**15, 1.5, True, "9", None])
async def test_absurd_priorities_are_refused_at_send(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, priority: object
) -> None:
    async with make_bus("sender", concurrency=0) as bus:
        with pytest.raises(InvalidMessage, match="priority"):
            await bus.send(Ping(n=1), to="billing", priority=priority)  # type: ignore[arg-type]
    assert await db.fetchval("SELECT to_regclass('nmbus.billing')") is None


# -- expiry ------------------------------------------------------------------------


async def test_an_expired_message_goes_to_f_unhandled_and_a_live_one_is_handled(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    async with make_bus("sender", concurrency=0) as sender:
        await sender.send(Ping(n=1), to="billing", ttl=0.5)
        await sender.send(Ping(n=2), to="billing", ttl=60)
    await wait_until("SELECT count(*) FROM nmbus.billing WHERE expires_at <= now()", db=db)
    seen: list[int] = []
    bus = make_bus("billing")

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)

    async with bus:
        await drain(bus)
    assert seen == [2]
    short, long = await rows(db)
    assert short["subqueue"] == "F"
    assert short["error_info"].startswith("Expired: test.Ping expired")
    assert long["subqueue"] == "X"
    assert long["error_info"] is None


async def test_expired_messages_are_dropped_to_x_when_the_endpoint_says_so(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    past = datetime.now(UTC) - timedelta(seconds=1)
    async with make_bus("sender", concurrency=0) as sender:
        await sender.send(Ping(n=1), to="billing", expires_at=past)
    bus = make_bus("billing", on_expired="drop")
    seen: list[int] = []

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)

    async with bus:
        await drain(bus)
    assert seen == []
    (row,) = await rows(db)
    assert row["subqueue"] == "X"
    assert row["error_info"].startswith("dropped: Expired:")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ttl": 0}, "ttl must be > 0"),
        ({"ttl": -1}, "ttl must be > 0"),
        ({"ttl": math.inf}, "ttl must be > 0"),
        ({"ttl": math.nan}, "ttl must be > 0"),
        ({"ttl": 1e12}, "ttl must be > 0"),
        ({"ttl": "5"}, "ttl must be a number"),
        ({"expires_at": datetime(2030, 1, 1)}, "timezone-aware"),
        ({"ttl": 5, "expires_at": datetime(2030, 1, 1, tzinfo=UTC)}, "not both"),
    ],
)
async def test_bad_expiries_are_refused_at_send(
    make_bus: Callable[..., Bus], kwargs: dict[str, object], match: str
) -> None:
    async with make_bus("sender", concurrency=0) as bus:
        with pytest.raises(InvalidMessage, match=match):
            await bus.send(Ping(n=1), to="billing", **kwargs)  # type: ignore[arg-type]


async def test_retention_clears_rows_that_expired_long_ago_and_no_worker_took(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    async with make_bus("sender", concurrency=0) as sender:
        await sender.send(Ping(n=1), to="billing", ttl=1)
        await sender.send(Ping(n=2), to="billing", ttl=3600)
        await sender.send(Ping(n=3), to="billing")
    # Expired two days ago, while nothing consumed the queue.
    await db.execute(
        "UPDATE nmbus.billing SET expires_at = now() - interval '2 days' WHERE msg_text LIKE '%1%'"
    )
    await advance(db, "nmbus", "billing")  # the rows' segment is an old one now
    bus = make_bus("billing", concurrency=0, retention_max_age=timedelta(days=1))
    async with bus:
        await bus.store.apply_retention("billing", bus.settings)
    assert [r["msg_text"] for r in await rows(db)] == ['{"n":2}', '{"n":3}']


# -- the failure port --------------------------------------------------------------


async def test_a_failed_message_stays_in_f_and_its_copy_goes_to_the_failure_port(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", dead_letter="errors")

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        if msg.n == 2:
            raise PermanentError("card declined")

    async with bus:
        await bus.send(Ping(n=1), to="billing", headers={"tenant": "t1"})
        await bus.send(Ping(n=2), to="billing", headers={"tenant": "t2"}, correlation_id="c-2")
        await drain(bus)
    ok, failed = await rows(db)
    assert (ok["subqueue"], failed["subqueue"]) == ("X", "F")
    (copy,) = await rows(db, "errors")
    assert copy["subqueue"] == "I"
    assert copy["from_endpoint"] == "billing"
    assert copy["label"] == "test.Ping"
    assert copy["msg_text"] == failed["msg_text"]
    assert copy["correlation_id"] == "c-2"
    assert json.loads(copy["msg_headers"]) == {
        "tenant": "t2",
        "nmbus-failed-queue": "billing",
        "nmbus-failed-id": str(failed["id"]),
        "nmbus-failed-unique-id": failed["unique_id"],
        "nmbus-failed-error": "PermanentError: card declined",
    }


async def test_expired_and_unknown_messages_reach_the_failure_port_too(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    async with make_bus("sender", concurrency=0) as sender:
        await sender.send(Ping(n=1), to="billing", expires_at=datetime.now(UTC))
    bus = make_bus("billing", dead_letter="errors")  # no handler for Ping: NoHandler
    async with bus:
        await bus.send(Ping(n=2), to="billing")
        await drain(bus)
    copies = await rows(db, "errors")
    errors = sorted(json.loads(r["msg_headers"])["nmbus-failed-error"] for r in copies)
    assert errors[0].startswith("Expired:")
    assert errors[1].startswith("NoHandler:")


async def test_the_failure_port_copy_is_rolled_back_with_a_batch_that_loses_its_lease(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", dead_letter="errors", lease_seconds=1.0)
    stolen = asyncio.Event()

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        await ctx.connection.execute("SELECT 1")  # a transaction is open
        # Another worker takes the row over while this one still runs.
        await db.execute("UPDATE nmbus.billing SET handling_client_id = 'thief'")
        stolen.set()
        raise PermanentError("too late")

    async with bus:
        await bus.send(Ping(n=1), to="billing")
        # The wait must not share `db` with the handler: one connection runs
        # one statement at a time.
        await wait_until(
            lambda: stolen.is_set() and not bus.worker.in_flight,
            timeout=10,
            what="the message taken over and let go",
        )
    assert await db.fetchval("SELECT to_regclass('nmbus.errors')") is None or (
        await db.fetchval("SELECT count(*) FROM nmbus.errors") == 0
    )


async def test_the_failure_port_endpoint_never_copies_into_itself(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("errors", dead_letter="errors")

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        raise PermanentError("still broken")

    async with bus:
        await bus.send(Ping(n=1), to="errors")
        await drain(bus)
    assert [r["subqueue"] for r in await rows(db, "errors")] == ["F"]


@pytest.mark.parametrize(
    "cycle", [["billing", "errors"], ["billing", "errors", "audit"]], ids=["2-cycle", "3-cycle"]
)
async def test_failure_ports_in_a_cycle_copy_a_failure_once_and_never_a_copy(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, cycle: list[str]
) -> None:
    # Each endpoint's failure port is the next one; the last one's is the first.
    buses = [
        make_bus(name, dead_letter=cycle[(i + 1) % len(cycle)], poll_interval=0.2)
        for i, name in enumerate(cycle)
    ]
    for bus in buses:

        @bus.handler
        async def on_ping(msg: Ping, ctx: Context) -> None:
            raise PermanentError("always broken")

    async with contextlib.AsyncExitStack() as stack:
        for bus in buses:
            await stack.enter_async_context(bus)
        await buses[0].send(Ping(n=1), to="billing")
        # Copying for ever would keep some queue busy: drain would time out.
        for _ in range(2):
            for bus in buses:
                await drain(bus, timeout=15, queues=cycle)
    original, *others = await rows(db, "billing")
    assert others == []
    assert original["subqueue"] == "F"
    (copy,) = await rows(db, "errors")
    assert copy["subqueue"] == "F"  # it failed too, and was not copied on
    assert json.loads(copy["msg_headers"])["nmbus-failed-id"] == str(original["id"])
    for name in cycle[2:]:
        assert await rows(db, name) == []


def test_a_failure_port_copy_is_nobodys_reply_and_no_sagas_timeout() -> None:
    # A failed reply, or a failed saga timeout, copied with its routing headers would
    # be handed back and forth between the port's processes, or act on a saga there.
    routing = {
        "nmbus-in-reply-to": "req-1",
        "nmbus-requester": "another-process",
        "nmbus-reply-by": "9999-12-31T00:00:00+00:00",
        "nmbus-saga": "Fulfilment",
        "nmbus-saga-key": "42",
        "nmbus-saga-instance": "0f0e",
    }
    kept = {"x-tenant": "t-7", "nmbus-reply-to": "orders", "traceparent": "00-ab-cd-01"}
    copy = dead_letter_copy(
        "billing", 7, "u-7", "test.Ping", '{"n":1}', json.dumps({**routing, **kept}), "c-1", "E"
    )
    assert copy is not None
    headers = json.loads(copy.msg_headers)
    assert not set(routing) & set(headers)
    assert {k: headers[k] for k in kept} == kept
    assert headers["nmbus-failed-queue"] == "billing" and headers["nmbus-failed-id"] == "7"
    assert copy.correlation_id == "c-1" and copy.msg_text == '{"n":1}'
