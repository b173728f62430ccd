"""Sagas on a real PostgreSQL: state in the endpoint's saga table, loaded under a
row lock and saved in the handler's transaction; timeouts; several processes."""

from __future__ import annotations

import asyncio
import collections
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from pydantic import BaseModel

from nmbus import Bus, Context, HandlerError, Message, Saga
from nmbus.consume.dispatch import MAX_FREE_CONFLICTS
from nmbus.consume.isolation import is_conflict
from nmbus.errors import ConfigurationError, StoreError
from nmbus.ports.store import SCHEMA_VERSION
from nmbus.sagas.locks import SagaLocks
from nmbus.testing import MemoryStore, drain
from tests.procs import Proc
from tests.saga_workers import Counter, Increment, Open, counter_bus
from tests.waits import wait_until

SAGAS_PAGE = (Path(__file__).resolve().parent.parent / "docs" / "sagas.md").read_text()


class OrderPlaced(Message, type_name="test.saga.OrderPlaced"):
    order_id: int


class PaymentTaken(Message, type_name="test.saga.PaymentTaken"):
    order_id: int


class Shipped(Message, type_name="test.saga.Shipped"):
    order_id: int


class Overdue(Message, type_name="test.saga.Overdue"):
    order_id: int


class Nudge(Message, type_name="test.saga.Nudge"):
    """A timeout message without the key field: it finds its saga by its headers."""

    note: str


class AuditOpened(Message, type_name="test.saga.AuditOpened"):
    name: str


class Keyed(Message, type_name="test.saga.Keyed"):
    key: object


class Fulfilment(BaseModel):
    order_id: int = 0
    paid: bool = False
    shipped: bool = False
    overdue_at: float | None = None


def fulfilment_bus(
    make_bus: Callable[..., Bus], events: list[str], timeout: float = 3600.0
) -> tuple[Bus, Saga[Fulfilment]]:
    bus = make_bus("orders", poll_interval=0.2, max_attempts=2, retry_delay=0.1)
    saga = bus.saga(Fulfilment, key="order_id")

    @saga.handler(start=True)
    async def placed(msg: OrderPlaced, state: Fulfilment, ctx: Context) -> None:
        state.order_id = msg.order_id
        await ctx.saga.timeout(timeout, Overdue(order_id=msg.order_id))
        events.append(f"placed {msg.order_id} {ctx.saga.name} {ctx.saga.key}")

    @saga.handler
    async def paid(msg: PaymentTaken, state: Fulfilment, ctx: Context) -> None:
        state.paid = True
        events.append(f"paid {msg.order_id}")
        if state.shipped:
            ctx.saga.complete()

    @saga.handler
    async def shipped(msg: Shipped, state: Fulfilment, ctx: Context) -> None:
        state.shipped = True
        events.append(f"shipped {msg.order_id}")
        if state.paid:
            ctx.saga.complete()

    @saga.handler
    async def overdue(msg: Overdue, state: Fulfilment, ctx: Context) -> None:
        state.overdue_at = time.time()
        events.append(f"overdue {msg.order_id}")

    return bus, saga


async def test_start_continue_load_complete(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    events: list[str] = []
    bus, saga = fulfilment_bus(make_bus, events)
    async with bus:
        await bus.send(OrderPlaced(order_id=42), to="orders")
        await drain(bus)
        state = await saga.load(42)
        assert state == Fulfilment(order_id=42)
        # The key is stored as text: "42" names the same saga.
        assert await saga.load("42") == state
        row = await db.fetchrow(
            'SELECT saga_type, saga_key, state, version FROM nmbus."orders$saga"'
        )
        assert (row["saga_type"], row["saga_key"], row["version"]) == ("Fulfilment", "42", 1)
        assert '"order_id": 42' in row["state"]
        # The timeout waits in R, correlated to the saga by its headers.
        timeout_row = await db.fetchrow(
            "SELECT subqueue, msg_headers FROM nmbus.orders WHERE label = 'test.saga.Overdue'"
        )
        assert timeout_row["subqueue"] == "R"
        assert '"nmbus-saga-key": "42"' in timeout_row["msg_headers"]

        await bus.send(PaymentTaken(order_id=42), to="orders")
        await drain(bus)
        assert await saga.load(42) == Fulfilment(order_id=42, paid=True)
        await bus.send(Shipped(order_id=42), to="orders")
        await drain(bus)
        assert await saga.load(42) is None
        assert await db.fetchval('SELECT count(*) FROM nmbus."orders$saga"') == 0
    assert events == ["placed 42 Fulfilment 42", "paid 42", "shipped 42"]
    counts = dict(await db.fetch("SELECT subqueue, count(*) FROM nmbus.orders GROUP BY 1"))
    assert counts == {"X": 3, "R": 1}


async def test_a_timeout_arrives_about_on_time(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    events: list[str] = []
    bus, saga = fulfilment_bus(make_bus, events, timeout=1.0)
    async with bus:
        started = time.time()
        await bus.send(OrderPlaced(order_id=7), to="orders")
        # Committed, not just run.
        state = await wait_until(
            lambda: saga.load(7),
            until=lambda state: state is not None and state.overdue_at is not None,
            timeout=10,
            interval=0.02,
        )
    late = state.overdue_at - started
    assert 1.0 <= late < 4.0, late


async def test_a_timeout_of_a_completed_saga_is_ignored(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    events: list[str] = []
    bus, _ = fulfilment_bus(make_bus, events, timeout=0.5)
    async with bus:
        await bus.send(OrderPlaced(order_id=8), to="orders")
        await bus.send(PaymentTaken(order_id=8), to="orders")
        await bus.send(Shipped(order_id=8), to="orders")
        await drain(bus)
        # The timeout comes due after the saga completed, and is handled (as nothing).
        await wait_until(
            "SELECT subqueue FROM nmbus.orders WHERE label = 'test.saga.Overdue'",
            db=db,
            until=lambda subqueue: subqueue == "X",
            timeout=10,
        )
    assert "overdue 8" not in events
    assert await db.fetchval("SELECT count(*) FROM nmbus.orders WHERE subqueue <> 'X'") == 0


async def test_saga_not_found_goes_to_f_unless_ignored(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    events: list[str] = []
    bus, _ = fulfilment_bus(make_bus, events)
    async with bus:
        await bus.send(PaymentTaken(order_id=99), to="orders")
        await drain(bus)
    row = await db.fetchrow("SELECT subqueue, retry_count, error_info FROM nmbus.orders")
    assert row["subqueue"] == "F"
    assert row["retry_count"] == 1  # not retried: it can never succeed
    assert row["error_info"].startswith("SagaNotFound: no Fulfilment saga with key '99'")

    quiet = make_bus("quiet", poll_interval=0.2)
    saga = quiet.saga(Fulfilment, key="order_id", on_missing="ignore")

    @saga.handler
    async def paid(msg: PaymentTaken, state: Fulfilment, ctx: Context) -> None:
        raise AssertionError("never called without a saga")

    async with quiet:
        await quiet.send(PaymentTaken(order_id=99), to="quiet")
        await drain(quiet)
    assert await db.fetchval("SELECT subqueue FROM nmbus.quiet") == "X"


async def test_one_message_starts_one_saga_and_continues_another(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    class Audit(BaseModel):
        orders: list[int] = []

    # One loop: the audit lists its orders in the order they were sent.
    bus = make_bus("orders", poll_interval=0.2, concurrency=1)
    fulfilment = bus.saga(Fulfilment, key="order_id")
    audit = bus.saga(Audit, key=lambda msg: "all", name="audit")

    @audit.handler(start=True)
    async def audit_start(msg: AuditOpened, state: Audit, ctx: Context) -> None:
        pass

    @audit.handler
    async def audit_placed(msg: OrderPlaced, state: Audit, ctx: Context) -> None:
        state.orders.append(msg.order_id)

    @fulfilment.handler(start=True)
    async def placed(msg: OrderPlaced, state: Fulfilment, ctx: Context) -> None:
        state.order_id = msg.order_id
        # The Nudge finds this saga by its headers, having no order_id.
        await ctx.saga.timeout(0, Nudge(note="hello"))

    @fulfilment.handler
    async def nudged(msg: Nudge, state: Fulfilment, ctx: Context) -> None:
        state.paid = True

    async with bus:
        await bus.send(AuditOpened(name="all"), to="orders")
        await drain(bus)
        await bus.send(OrderPlaced(order_id=1), to="orders")
        await bus.send(OrderPlaced(order_id=2), to="orders")
        await drain(bus)
        assert await audit.load("all") == Audit(orders=[1, 2])
        assert await fulfilment.load(1) == Fulfilment(order_id=1, paid=True)
        assert await fulfilment.load(2) == Fulfilment(order_id=2, paid=True)
    # OrderPlaced started a Fulfilment and continued the audit, in one transaction.
    assert await db.fetchval("SELECT count(*) FROM nmbus.orders WHERE subqueue <> 'X'") == 0


async def test_a_failing_handler_saves_nothing(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("counting", poll_interval=0.2, max_attempts=1)
    saga = bus.saga(Counter, key="counter")

    @saga.handler(start=True)
    async def increment(msg: Increment, state: Counter, ctx: Context) -> None:
        state.count += 1
        await ctx.send(Increment(counter="elsewhere", n=0), to="elsewhere")
        if msg.n == 2:
            raise RuntimeError("boom")

    async with bus:
        for n in range(4):
            await bus.send(Increment(counter="c", n=n), to="counting")
        await drain(bus)
        assert await saga.load("c") == Counter(count=3)
    assert await db.fetchval("SELECT count(*) FROM nmbus.elsewhere") == 3


@pytest.mark.parametrize(
    ("key", "error"),
    [
        ("x" * 1001, "PermanentError: a saga key is at most 1000 bytes"),
        ("a\x00b", "PermanentError: saga key contains a NUL character"),
        (1.5, "PermanentError: a saga key must be a str, an int or a UUID, got float"),
        (None, "PermanentError: a saga key must be a str, an int or a UUID, got NoneType"),
        (True, "PermanentError: a saga key must be a str, an int or a UUID, got bool"),
        ("", "PermanentError: a saga key must not be empty"),
    ],
)
async def test_hostile_keys_go_to_f_at_once(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, key: object, error: str
) -> None:
    bus = make_bus("keyed", poll_interval=0.2)
    saga = bus.saga(Counter, key="key")

    @saga.handler(start=True)
    async def keyed(msg: Keyed, state: Counter, ctx: Context) -> None:
        state.count += 1

    async with bus:
        await bus.send(Keyed(key=key), to="keyed")
        await drain(bus)
    row = await db.fetchrow("SELECT subqueue, error_info FROM nmbus.keyed")
    assert row["subqueue"] == "F"
    assert row["error_info"].startswith(error), row["error_info"]
    assert await db.fetchval('SELECT count(*) FROM nmbus."keyed$saga"') == 0


async def test_odd_but_valid_keys_work(make_bus: Callable[..., Bus]) -> None:
    bus = make_bus("keyed", poll_interval=0.2)
    saga = bus.saga(Counter, key="key")

    @saga.handler(start=True)
    async def keyed(msg: Keyed, state: Counter, ctx: Context) -> None:
        state.count += 1

    keys = ["'; DROP TABLE nmbus.keyed; --", "ключ 🗝", "x" * 1000, -5, 2**70]
    async with bus:
        for key in keys:
            await bus.send(Keyed(key=key), to="keyed")
            await bus.send(Keyed(key=key), to="keyed")
        await drain(bus)
        for key in keys:
            assert await saga.load(key) == Counter(count=2)
    with pytest.raises(TypeError):
        await saga.load(1.5)


def test_registration_is_checked_at_once(make_bus: Callable[..., Bus]) -> None:
    bus = make_bus("orders")
    saga = bus.saga(Fulfilment, key="order_id")
    with pytest.raises(HandlerError, match=r"\(msg, state, ctx\)"):

        @saga.handler
        async def two(msg: OrderPlaced, ctx: Context) -> None: ...

    with pytest.raises(HandlerError, match="does not have"):

        @saga.handler(start=True)
        async def keyless(msg: Nudge, state: Fulfilment, ctx: Context) -> None: ...

    with pytest.raises(HandlerError, match="annotate"):

        @saga.handler
        async def bare(msg, state, ctx) -> None:  # type: ignore[no-untyped-def]
            ...

    with pytest.raises(ConfigurationError, match="already has a saga"):
        bus.saga(Fulfilment, key="order_id")

    class Required(BaseModel):
        order_id: int

    with pytest.raises(ConfigurationError, match="no arguments"):
        bus.saga(Required, key="order_id")
    with pytest.raises(ConfigurationError, match="not a Message"):
        bus.saga(OrderPlaced, key="order_id")
    with pytest.raises(ConfigurationError, match="on_missing"):
        bus.saga(Counter, key="counter", on_missing="drop")


async def test_ctx_saga_outside_a_saga_handler_is_refused(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("plain", poll_interval=0.2, max_attempts=1)

    @bus.handler
    async def plain(msg: OrderPlaced, ctx: Context) -> None:
        ctx.saga.complete()

    async with bus:
        await bus.send(OrderPlaced(order_id=1), to="plain")
        await drain(bus)
    info = await db.fetchval("SELECT error_info FROM nmbus.plain")
    assert info.startswith("ConfigurationError: ctx.saga is only available in a saga handler")


async def test_the_memory_store_refuses_sagas_at_start() -> None:
    bus = Bus("orders", store=MemoryStore())
    bus.saga(Fulfilment, key="order_id")
    with pytest.raises(ConfigurationError, match="PostgreSQL"):
        await bus.start()


async def _wait_count(db: asyncpg.Connection, queue: str, total: int, timeout: float) -> None:
    """Wait for ``total`` rows of ``queue`` in X; a row in F fails the wait at once."""

    async def done() -> int:
        failed = await db.fetch(f"SELECT error_info FROM nmbus.{queue} WHERE subqueue = 'F'")
        assert not failed, failed[0]["error_info"]
        return int(await db.fetchval(f"SELECT count(*) FROM nmbus.{queue} WHERE subqueue = 'X'"))

    await wait_until(done, until=lambda n: n >= total, timeout=timeout, interval=0.1)


@pytest.mark.timeout(120)
async def test_forty_increments_from_two_processes_give_forty(
    dsn: str, db: asyncpg.Connection
) -> None:
    sender = counter_bus(dsn, "counting", concurrency=0)
    async with sender:  # creates the queue and saga tables
        pass
    procs = [Proc("tests.saga_workers", "counter", dsn, "counting", "2", "2", "-1") for _ in "ab"]
    try:
        for proc in procs:
            await proc.wait_for("ready")
        async with counter_bus(dsn, "counting", concurrency=0) as bus:
            # Started first: an Increment handled before would find no saga (F).
            await bus.send(Open(counter="one"), to="counting")
            await _wait_count(db, "counting", 1, 30)
            for n in range(40):
                await bus.send(Increment(counter="one", n=n), to="counting")
            await _wait_count(db, "counting", 41, 90)
            state = await bus.sagas["Counter"].load("one")
    finally:
        for proc in procs:
            proc.kill()
    assert state is not None
    assert state.count == 40
    assert sorted(state.seen) == list(range(40))
    # Both processes took their share (each has two loops on the one saga).
    assert len(state.pids) == 2, state.pids
    assert await db.fetchval('SELECT version FROM nmbus."counting$saga"') == 41


@pytest.mark.timeout(150)
async def test_a_worker_killed_between_load_and_save_loses_no_update(
    dsn: str, db: asyncpg.Connection
) -> None:
    total, pill = 20, 7
    async with counter_bus(dsn, "counting", concurrency=0) as bus:
        await bus.send(Open(counter="one"), to="counting")
        for n in range(total):
            await bus.send(Increment(counter="one", n=n), to="counting")
    lines: list[str] = []
    deadline = time.monotonic() + 100
    while await db.fetchval("SELECT count(*) FROM nmbus.counting WHERE subqueue IN ('I', 'R')"):
        assert time.monotonic() < deadline, lines[-20:]
        proc = Proc("tests.saga_workers", "counter", dsn, "counting", "1", "4", str(pill))
        try:
            while proc.popen.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                if not await db.fetchval(
                    "SELECT count(*) FROM nmbus.counting WHERE subqueue IN ('I', 'R')"
                ):
                    break
        finally:
            proc.kill()
            lines.extend(proc.lines)
    assert f"killing at {pill}" in lines
    async with counter_bus(dsn, "counting", concurrency=0) as bus:
        state = await bus.sagas["Counter"].load("one")
    assert state is not None
    assert sorted(state.seen) == list(range(total)), state.seen
    assert state.count == total
    handled = await db.fetchval("SELECT count(*) FROM nmbus.counting WHERE subqueue = 'X'")
    assert handled == total + 1


async def test_concurrent_start_messages_create_one_saga(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # Four loops, one message per batch: the starts race to create the same row.
    bus = make_bus("counting", poll_interval=0.2, concurrency=4, batch_size=1)
    saga = bus.saga(Counter, key="counter")

    @saga.handler(start=True)
    async def increment(msg: Increment, state: Counter, ctx: Context) -> None:
        state.count += 1
        state.seen.append(msg.n)
        await asyncio.sleep(0.01)

    async with bus:
        for n in range(20):
            await bus.send(Increment(counter="raced", n=n), to="counting")
        await drain(bus, timeout=30)
        state = await saga.load("raced")
    assert state is not None and state.count == 20
    assert sorted(state.seen) == list(range(20))
    assert await db.fetchval("SELECT count(*) FROM nmbus.counting WHERE subqueue <> 'X'") == 0


async def test_the_sql_of_the_sagas_page_runs_as_written(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    blocks = re.findall(r"```sql\n(.*?)```", SAGAS_PAGE, re.DOTALL)
    statements = [s.strip() for block in blocks for s in block.split(";") if s.strip()]
    assert len(statements) == 5
    bus = make_bus("fulfilment", poll_interval=0.2)
    saga = bus.saga(Fulfilment, key="order_id")

    @saga.handler(start=True)
    async def placed(msg: OrderPlaced, state: Fulfilment, ctx: Context) -> None:
        state.order_id = msg.order_id
        await ctx.saga.timeout(3600, Overdue(order_id=msg.order_id))

    @saga.handler
    async def paid(msg: PaymentTaken, state: Fulfilment, ctx: Context) -> None:
        state.paid = True

    async with bus:
        await bus.send(OrderPlaced(order_id=42), to="fulfilment")
        await bus.send(PaymentTaken(order_id=7), to="fulfilment")  # no saga: F
        await drain(bus)
    results = [await db.fetch(sql) for sql in statements]
    running, one, waiting, timeouts, not_found = results
    assert [r["saga_key"] for r in running] == ["42"]
    assert '"order_id": 42' in one[0]["state"]
    assert waiting == []  # created just now
    assert [r["label"] for r in timeouts] == ["test.saga.Overdue"]
    assert len(not_found) == 1


# -- a timeout belongs to the saga instance that set it ----------------------------


class Begin(Message, type_name="test.saga.Begin"):
    order_id: int
    after: float


class Finish(Message, type_name="test.saga.Finish"):
    order_id: int


class Due(Message, type_name="test.saga.Due"):
    order_id: int


class Life(BaseModel):
    due: int = 0


def life_bus(
    make_bus: Callable[..., Bus], events: list[str], due_starts: bool = False
) -> tuple[Bus, Saga[Life]]:
    """Begin sets a timeout ``after`` seconds; Finish completes; Due counts (and may start)."""
    bus = make_bus("lives", poll_interval=0.2, max_attempts=2, retry_delay=0.1)
    saga = bus.saga(Life, key="order_id")

    @saga.handler(start=True)
    async def begin(msg: Begin, state: Life, ctx: Context) -> None:
        await ctx.saga.timeout(msg.after, Due(order_id=msg.order_id))
        events.append(f"begin {msg.order_id}")

    @saga.handler
    async def finish(msg: Finish, state: Life, ctx: Context) -> None:
        ctx.saga.complete()
        events.append(f"finish {msg.order_id}")

    @saga.handler(start=due_starts)
    async def due(msg: Due, state: Life, ctx: Context) -> None:
        state.due += 1
        events.append(f"due {msg.order_id}")

    return bus, saga


async def _first_timeout_done(db: asyncpg.Connection, first_id: int) -> asyncpg.Record:
    sql = "SELECT subqueue, error_info, retry_count FROM nmbus.lives WHERE id = $1"
    return await wait_until(lambda: db.fetchrow(sql, first_id), until=_finished, timeout=20)


def _due_ran(state: Life | None) -> bool:
    return state is not None and state.due > 0


async def test_an_old_sagas_timeout_does_not_act_on_a_new_saga_with_the_same_key(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    events: list[str] = []
    bus, saga = life_bus(make_bus, events)
    async with bus:
        await bus.send(Begin(order_id=5, after=1.0), to="lives")
        await drain(bus)
        first_id = await db.fetchval("SELECT id FROM nmbus.lives WHERE label = 'test.saga.Due'")
        await bus.send(Finish(order_id=5), to="lives")
        await drain(bus)
        # The same key again: a new saga, whose own timeout is an hour away.
        await bus.send(Begin(order_id=5, after=3600), to="lives")
        await drain(bus)
        first = await _first_timeout_done(db, first_id)
        await drain(bus)
        state = await saga.load(5)
    assert events == ["begin 5", "finish 5", "begin 5"]
    assert state == Life(due=0)
    assert first["subqueue"] == "X"
    assert first["error_info"].startswith("saga timeout ignored: the Life saga with key '5'")
    assert "completed and started again" in first["error_info"]
    # The new saga's own timeout still waits, and names the new instance.
    pending = await db.fetchval(
        "SELECT msg_headers->>'nmbus-saga-instance' FROM nmbus.lives "
        "WHERE label = 'test.saga.Due' AND subqueue = 'R'"
    )
    assert pending == await db.fetchval('SELECT instance::text FROM nmbus."lives$saga"')


async def test_an_old_sagas_timeout_does_not_start_the_completed_saga_again(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    events: list[str] = []
    # Due may start a saga too: a stale one must still not re-create the completed saga.
    bus, saga = life_bus(make_bus, events, due_starts=True)
    async with bus:
        await bus.send(Begin(order_id=6, after=0.5), to="lives")
        await drain(bus)
        first_id = await db.fetchval("SELECT id FROM nmbus.lives WHERE label = 'test.saga.Due'")
        await bus.send(Finish(order_id=6), to="lives")
        await drain(bus)
        first = await _first_timeout_done(db, first_id)
        await drain(bus)
        state = await saga.load(6)
    assert events == ["begin 6", "finish 6"]
    assert state is None
    assert await db.fetchval('SELECT count(*) FROM nmbus."lives$saga"') == 0
    assert first["subqueue"] == "X"
    assert first["error_info"] == (
        "saga timeout ignored: the Life saga with key '6' that set it has completed"
    )


async def test_a_timeout_from_before_the_instance_header_acts_as_it_did(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    events: list[str] = []
    bus, saga = life_bus(make_bus, events)
    async with bus:
        await bus.send(Begin(order_id=7, after=1.0), to="lives")
        await drain(bus)
        # As a timeout sent by an older nmbus: name and key only.
        await db.execute(
            "UPDATE nmbus.lives SET msg_headers = msg_headers - 'nmbus-saga-instance' "
            "WHERE label = 'test.saga.Due'"
        )
        await wait_until(lambda: saga.load(7), until=_due_ran, timeout=20)
    assert events == ["begin 7", "due 7"]
    assert await db.fetchval("SELECT count(*) FROM nmbus.lives WHERE subqueue <> 'X'") == 0


async def test_schema_8_adds_the_instance_column_to_existing_saga_tables_in_place(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    events: list[str] = []
    bus, saga = life_bus(make_bus, events)
    async with bus:
        await bus.send(Begin(order_id=8, after=3600), to="lives")
        await drain(bus)
    # Back to a schema 7 saga table: no instance column, a running saga in it.
    await db.execute('ALTER TABLE nmbus."lives$saga" DROP COLUMN instance')
    await db.execute('VACUUM FULL nmbus."lives$saga"')
    await db.execute("DELETE FROM nmbus.schema_version WHERE version > 7")
    await db.execute("INSERT INTO nmbus.schema_version (version) VALUES (7) ON CONFLICT DO NOTHING")
    await db.execute("UPDATE nmbus.lives SET msg_headers = msg_headers - 'nmbus-saga-instance'")
    file_before = await db.fetchval("SELECT pg_relation_filenode('nmbus.\"lives$saga\"')")
    bus, saga = life_bus(make_bus, events)
    async with bus:
        # Migrated in place (catalog-only): the same file, the row kept, no instance yet.
        assert await db.fetchval("SELECT max(version) FROM nmbus.schema_version") == SCHEMA_VERSION
        file_after = await db.fetchval("SELECT pg_relation_filenode('nmbus.\"lives$saga\"')")
        assert file_after == file_before
        assert await db.fetchval('SELECT instance FROM nmbus."lives$saga"') is None
        assert await saga.load(8) == Life()
        # Its next message gives it an instance, which its new timeouts carry.
        await bus.send(Begin(order_id=8, after=0.3), to="lives")
        await drain(bus)
        instance = await db.fetchval('SELECT instance::text FROM nmbus."lives$saga"')
        assert instance is not None
        carried = await db.fetchval(
            "SELECT msg_headers->>'nmbus-saga-instance' FROM nmbus.lives "
            "WHERE label = 'test.saga.Due' AND msg_headers ? 'nmbus-saga-instance'"
        )
        assert carried == instance
        await wait_until(lambda: saga.load(8), until=_due_ran, timeout=20)
    assert events.count("due 8") == 1


# -- several loops and processes on few sagas ---------------------------------------


async def _deadlocks(db: asyncpg.Connection) -> int:
    await db.execute("SELECT pg_stat_clear_snapshot()")
    return int(
        await db.fetchval(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        )
    )


@pytest.mark.timeout(240)
# 0.5 s: each batch commits once. 0.01 s: a batch commits in parts every few handlers,
# and the rest of the batch must take its sagas' locks again, in order, after each part.
@pytest.mark.parametrize("commit_interval", ["0.5", "0.01"], ids=["whole", "in-parts"])
async def test_two_processes_of_two_loops_on_three_sagas_never_deadlock_nor_lose_an_update(
    dsn: str, db: asyncpg.Connection, commit_interval: str
) -> None:
    keys, per_key = ["a", "b", "c"], 40
    total = len(keys) * per_key
    async with counter_bus(dsn, "counting", concurrency=0) as bus:
        # Interleaved: every batch of 10 needs all three sagas; any Increment may start one.
        for n in range(total):
            await bus.send(Increment(counter=keys[n % 3], n=n), to="counting")
    before = await _deadlocks(db)
    procs = [
        Proc("tests.saga_workers", "starts", dsn, "counting", "2", "10", "", commit_interval)
        for _ in "ab"
    ]
    try:
        for proc in procs:
            await proc.wait_for("ready")
        await _wait_count(db, "counting", total, 200)
    finally:
        for proc in procs:
            proc.kill()
    async with counter_bus(dsn, "counting", concurrency=0) as bus:
        states = {key: await bus.sagas["Counter"].load(key) for key in keys}
    for i, key in enumerate(keys):
        state = states[key]
        assert state is not None
        assert sorted(state.seen) == list(range(i, total, 3)), (key, state.seen)
        assert state.count == per_key
    assert await db.fetchval("SELECT count(*) FROM nmbus.counting WHERE subqueue = 'F'") == 0
    assert await db.fetchval('SELECT count(*) FROM nmbus."counting$saga"') == len(keys)
    # The processes have exited, so their statistics are flushed (give the server a moment).
    await asyncio.sleep(1.0)
    assert await _deadlocks(db) - before == 0


# -- a deadlock costs no attempt ---------------------------------------------------


class Pair(Message, type_name="test.saga.Pair"):
    note: str = ""


async def _deadlock_once(
    dsn: str, db: asyncpg.Connection, holding: asyncio.Event, go: asyncio.Event
) -> None:
    """When the worker holds row 1 and is about to want row 2: hold row 2, want row 1.

    This connection waits 60 s before it looks for a deadlock, the worker's 0.1 s:
    the worker's statement is the one PostgreSQL aborts.
    """
    other = await asyncpg.connect(dsn)
    try:
        await other.execute("SET deadlock_timeout = '60s'")
        async with asyncio.timeout(20):
            await holding.wait()
        async with other.transaction():
            await other.execute("UPDATE pair SET v = v + 10 WHERE id = 2")
            go.set()
            async with asyncio.timeout(20):
                await other.execute("UPDATE pair SET v = v + 10 WHERE id = 1")
    finally:
        await other.close()


SELECT_PAIR = "SELECT subqueue, retry_count, error_info FROM nmbus.locking WHERE id = 1"


async def _wait_done(db: asyncpg.Connection, queue: str) -> asyncpg.Record:
    sql = f"SELECT subqueue, retry_count, error_info FROM nmbus.{queue} WHERE id = 1"
    return await wait_until(lambda: db.fetchrow(sql), until=_finished, timeout=20)


def _finished(row: asyncpg.Record | None) -> bool:
    return row is not None and row["subqueue"] in ("X", "F")


@pytest.mark.parametrize("outside_effects", [True, False], ids=["savepoint", "replayed"])
async def test_a_handler_that_loses_a_deadlock_is_retried_without_spending_an_attempt(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str, outside_effects: bool
) -> None:
    await db.execute("CREATE TABLE pair (id int PRIMARY KEY, v int NOT NULL)")
    await db.execute("INSERT INTO pair VALUES (1, 0), (2, 0)")
    # One attempt only: a deadlock that counted would send the message to F.
    bus = make_bus("locking", poll_interval=0.2, max_attempts=1)
    holding, go = asyncio.Event(), asyncio.Event()
    runs: list[int] = []

    @bus.handler(outside_effects=outside_effects)
    async def both(msg: Pair, ctx: Context) -> None:
        runs.append(ctx.retry_count)
        await ctx.connection.execute("SET LOCAL deadlock_timeout = '100ms'")
        await ctx.connection.execute("UPDATE pair SET v = v + 1 WHERE id = 1")
        if len(runs) == 1:
            holding.set()
            await go.wait()
        await ctx.connection.execute("UPDATE pair SET v = v + 1 WHERE id = 2")

    async with bus:
        await bus.send(Pair(), to="locking")
        await _deadlock_once(dsn, db, holding, go)
        row = await _wait_done(db, "locking")
    assert row["subqueue"] == "X", row["error_info"]
    assert row["retry_count"] == 1
    assert runs == [1, 1]
    # The lost run left nothing; the run that won and the other transaction did.
    assert dict(await db.fetch("SELECT id, v FROM pair")) == {1: 11, 2: 11}


@pytest.mark.parametrize("outside_effects", [True, False], ids=["savepoint", "replayed"])
async def test_a_handler_that_conflicts_every_time_reaches_f_after_its_free_retries(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, outside_effects: bool
) -> None:
    # A trigger or function that raises serialization_failure whatever happens: the
    # refund of a conflict's attempt must not retry such a message for ever.
    await db.execute(
        "CREATE FUNCTION always_conflicts() RETURNS void LANGUAGE plpgsql AS $$ BEGIN "
        "RAISE EXCEPTION 'could not serialize' USING ERRCODE = 'serialization_failure'; "
        "END $$"
    )
    bus = make_bus("locking", poll_interval=0.2, max_attempts=2, retry_delay=0.01)
    runs: list[int] = []

    @bus.handler(outside_effects=outside_effects)
    async def conflicts(msg: Pair, ctx: Context) -> None:
        runs.append(ctx.retry_count)
        await ctx.connection.execute("SELECT always_conflicts()")

    async with bus:
        await bus.send(Pair(), to="locking")
        async with asyncio.timeout(120):
            while (row := await db.fetchrow(SELECT_PAIR)) is None or row["subqueue"] != "F":
                await asyncio.sleep(0.05)
    assert row["retry_count"] == 2
    assert "SerializationError" in row["error_info"]
    # The free retries, then the two attempts max_attempts allows.
    assert len(runs) == MAX_FREE_CONFLICTS + 2


async def test_a_batch_that_loses_a_deadlock_outside_its_handlers_runs_again_at_no_cost(
    make_bus: Callable[..., Bus],
    db: asyncpg.Connection,
    dsn: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await db.execute("CREATE TABLE pair (id int PRIMARY KEY, v int NOT NULL)")
    await db.execute("INSERT INTO pair VALUES (1, 0), (2, 0)")
    bus = make_bus("locking", poll_interval=0.2, max_attempts=1)
    bus.saga(Counter, key="counter")  # the endpoint's batches take their saga locks
    holding, go = asyncio.Event(), asyncio.Event()
    hooks: list[int] = []
    runs: list[int] = []
    prepare = SagaLocks.prepare

    async def before_handlers(
        self: SagaLocks, tx: Any, rows: list[Any], wait: bool, table: Any
    ) -> set[int]:
        # Statements of the batch's own, outside any handler's savepoint (as the
        # saga locks' are): a deadlock here aborts the whole batch's transaction.
        hooks.append(len(rows))
        await tx.begin()
        await tx.connection.execute("SET LOCAL deadlock_timeout = '100ms'")
        await tx.connection.execute("UPDATE pair SET v = v + 1 WHERE id = 1")
        if len(hooks) == 1:
            holding.set()
            await go.wait()
        await tx.connection.execute("UPDATE pair SET v = v + 1 WHERE id = 2")
        return await prepare(self, tx, rows, wait, table)

    monkeypatch.setattr(SagaLocks, "prepare", before_handlers)

    @bus.handler
    async def handled(msg: Pair, ctx: Context) -> None:
        runs.append(ctx.retry_count)

    async with bus:
        await bus.send(Pair(), to="locking")
        await _deadlock_once(dsn, db, holding, go)
        row = await _wait_done(db, "locking")
    assert row["subqueue"] == "X", row["error_info"]
    assert row["retry_count"] == 1
    assert hooks == [1, 1]
    assert runs == [1]
    assert dict(await db.fetch("SELECT id, v FROM pair")) == {1: 11, 2: 11}


@pytest.mark.timeout(240)
async def test_a_thousand_starts_on_five_hundred_keys_from_two_processes_make_five_hundred_sagas(
    dsn: str, db: asyncpg.Connection
) -> None:
    keys = 500
    async with counter_bus(dsn, "counting", concurrency=0) as bus:
        for n in range(2 * keys):
            await bus.send(Increment(counter=f"k{n % keys}", n=n), to="counting")
    procs = [Proc("tests.saga_workers", "starts", dsn, "counting", "2", "20") for _ in "ab"]
    try:
        for proc in procs:
            await proc.wait_for("ready")
        await _wait_count(db, "counting", 2 * keys, 200)
    finally:
        for proc in procs:
            proc.kill()
    rows = await db.fetch('SELECT saga_key, state FROM nmbus."counting$saga"')
    assert len(rows) == keys
    counts = {r["saga_key"]: Counter.model_validate_json(r["state"]).count for r in rows}
    assert counts == {f"k{k}": 2 for k in range(keys)}
    assert await db.fetchval("SELECT count(*) FROM nmbus.counting WHERE subqueue <> 'X'") == 0


@pytest.mark.timeout(300)
async def test_sigkills_of_two_processes_of_two_loops_on_five_sagas_lose_and_double_nothing(
    dsn: str, db: asyncpg.Connection
) -> None:
    keys, total = 5, 600
    # Whichever process handles one of these first SIGKILLs itself, between load and save.
    pills = "100,250,400,550"
    async with counter_bus(dsn, "counting", concurrency=0) as bus:
        for n in range(total):
            await bus.send(Increment(counter=f"k{n % keys}", n=n), to="counting")

    def start() -> Proc:
        return Proc("tests.saga_workers", "starts", dsn, "counting", "2", "10", pills)

    procs = [start(), start()]
    lines: list[str] = []
    done = "SELECT count(*) FROM nmbus.counting WHERE subqueue = 'X'"
    try:
        for proc in procs:
            await proc.wait_for("ready")
        async with asyncio.timeout(240):
            while await db.fetchval(done) < total:
                failed = "SELECT error_info FROM nmbus.counting WHERE subqueue = 'F'"
                assert not await db.fetch(failed)
                for index, proc in enumerate(procs):
                    if proc.popen.poll() is not None:
                        proc.kill()
                        lines.extend(proc.lines)
                        procs[index] = start()
                        await procs[index].wait_for("ready")
                await asyncio.sleep(0.1)
    finally:
        for proc in procs:
            proc.kill()
            lines.extend(proc.lines)
    kills = collections.Counter(line for line in lines if line.startswith("killing"))
    # Each pill kills on its first attempt. A pill that died in a batch and was not the
    # suspect kept alone is let go with that attempt given back (nothing said it was the
    # one), so it may kill once more, alone; then its attempt counts, and it kills no more.
    assert set(kills) == {f"killing at {n}" for n in pills.split(",")}
    assert all(1 <= times <= 2 for times in kills.values()), kills
    rows = await db.fetch('SELECT saga_key, state FROM nmbus."counting$saga"')
    seen = {r["saga_key"]: Counter.model_validate_json(r["state"]).seen for r in rows}
    # Every increment counted exactly once: none lost, none doubled.
    assert {k: sorted(v) for k, v in seen.items()} == {
        f"k{k}": list(range(k, total, keys)) for k in range(keys)
    }


def test_a_conflict_is_found_through_the_chain_a_traceback_shows() -> None:
    deadlock = asyncpg.exceptions.DeadlockDetectedError("deadlock detected")
    wrapped = StoreError("batch transaction: DeadlockDetectedError: deadlock detected")
    wrapped.__cause__ = deadlock
    assert is_conflict(deadlock) and is_conflict(wrapped)
    assert is_conflict(asyncpg.exceptions.SerializationError("could not serialize"))
    try:
        try:
            raise deadlock
        except asyncpg.PostgresError:
            raise ValueError("the handler's own error, raised while handling it") from None
    except ValueError as own:
        assert not is_conflict(own)
    assert not is_conflict(StoreError("unique violation"))
