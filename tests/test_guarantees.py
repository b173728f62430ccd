"""One test per guarantee of DESIGN.md section 2, against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import subprocess
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg

from nmbus import Bus, Context, PermanentError, RetryLater, RetryPolicy
from nmbus.testing import drain
from tests import procs
from tests.messages import Crash, Event, OrderPlaced, Ping, Pong, Slow
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parent.parent


class Proc(procs.Proc):
    def __init__(self, *args: str) -> None:
        super().__init__("tests.workers", *args)


async def rows(db: asyncpg.Connection, queue: str = "billing") -> list[asyncpg.Record]:
    return await db.fetch(f'SELECT * FROM nmbus."{queue}" ORDER BY id')


# -- 1. durability -------------------------------------------------------------------


async def test_a_returned_send_survives_the_sender_being_killed(
    dsn: str, db: asyncpg.Connection
) -> None:
    sender = Proc("sender", dsn, "billing", "100000")
    try:
        await sender.wait_for("ready")
        while sum(len(line) == 32 for line in sender.lines) < 200:
            await sender.wait_for("")
        sender.kill()
    finally:
        sender.kill()
    returned = [line for line in sender.lines if len(line) == 32]
    assert len(returned) >= 200
    stored = {r["unique_id"] for r in await rows(db)}
    missing = [uid for uid in returned if uid not in stored]
    assert missing == []


# -- 2. at-least-once, dedup -------------------------------------------------------


async def test_a_resent_unique_id_is_stored_once(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    async with make_bus("orders", concurrency=0) as bus:
        first = await bus.send(Ping(n=1), to="billing", unique_id="order-1")
        again = await bus.send(Ping(n=2), to="billing", unique_id="order-1")
        other = await bus.send(Ping(n=3), to="billing")
    assert first == again == "order-1"
    stored = await rows(db)
    assert [(r["unique_id"], r["msg_text"]) for r in stored] == [
        ("order-1", '{"n":1}'),
        (other, '{"n":3}'),
    ]


async def test_every_message_is_handled(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", concurrency=3, batch_size=7)
    seen: list[int] = []

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)

    async with bus:
        for n in range(200):
            await bus.send(Ping(n=n), to="billing")
        await drain(bus)
    assert sorted(seen) == list(range(200))
    assert {r["subqueue"] for r in await rows(db)} == {"X"}


# -- 3. transactional handling and the outbox ------------------------------------------


async def test_handler_writes_and_sends_commit_with_the_message(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    await db.execute("CREATE TABLE effects (n int PRIMARY KEY)")
    bus = make_bus("billing", max_attempts=1)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        await ctx.connection.execute("INSERT INTO effects (n) VALUES ($1)", msg.n)
        await ctx.send(Pong(n=msg.n), to="audit")
        if msg.n % 2:
            raise ValueError(f"odd {msg.n}")

    async with bus:
        for n in range(6):
            await bus.send(Ping(n=n), to="billing")
        await drain(bus)

    assert [r["n"] for r in await db.fetch("SELECT n FROM effects ORDER BY n")] == [0, 2, 4]
    audit = await rows(db, "audit")
    assert sorted(r["msg_text"] for r in audit) == ['{"n":0}', '{"n":2}', '{"n":4}']
    by_n = {r["msg_text"]: r["subqueue"] for r in await rows(db)}
    assert by_n == {f'{{"n":{n}}}': ("F" if n % 2 else "X") for n in range(6)}


async def test_a_handler_that_swallows_a_database_error_fails(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", max_attempts=1)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        with contextlib.suppress(asyncpg.UndefinedTableError):
            await ctx.connection.execute("SELECT * FROM no_such_table")

    async with bus:
        await bus.send(Ping(n=1), to="billing")
        await bus.send(Ping(n=2), to="billing")
        await drain(bus)
    assert [r["subqueue"] for r in await rows(db)] == ["F", "F"]
    assert "InFailedSQLTransaction" in (await rows(db))[0]["error_info"]


async def test_outbox_send_exists_exactly_when_the_caller_commits(
    make_bus: Callable[..., Bus], dsn: str, db: asyncpg.Connection
) -> None:
    async with make_bus("orders", concurrency=0) as bus:
        await bus.store.ensure_queue("billing")
        conn = await asyncpg.connect(dsn)
        try:
            tx = conn.transaction()
            await tx.start()
            await bus.send(Ping(n=1), to="billing", connection=conn)
            assert await rows(db) == []  # invisible until commit
            await tx.rollback()
            assert await rows(db) == []  # gone with the rollback

            async with conn.transaction():
                await bus.send(Ping(n=2), to="billing", connection=conn)
                await bus.publish(Ping(n=3), connection=conn)
                assert await rows(db) == []
        finally:
            await conn.close()
    assert [r["msg_text"] for r in await rows(db)] == ['{"n":2}']


async def test_outbox_send_to_a_new_queue_needs_no_second_connection(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # The caller holds the pool's only connection; the queue table does not exist yet.
    async with make_bus("orders", concurrency=0, send_pool_size=1) as bus:
        pool = bus.store.pool  # type: ignore[attr-defined]
        async with asyncio.timeout(10):
            async with pool.acquire() as conn:
                tx = conn.transaction()
                await tx.start()
                await bus.send(Ping(n=1), to="fresh_queue", connection=conn)
                await tx.rollback()
                assert await db.fetchval("SELECT to_regclass('nmbus.fresh_queue')") is None
                async with conn.transaction():
                    await bus.send(Ping(n=2), to="fresh_queue", connection=conn)
    assert [r["msg_text"] for r in await rows(db, "fresh_queue")] == ['{"n":2}']


# -- 4. retries, F, and workers killed mid-handler ----------------------------------------


async def test_failures_retry_on_schedule_then_fail(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    policy = RetryPolicy(max_attempts=3, initial_delay=0.2, backoff=2, jitter=0)
    bus = make_bus("billing", poll_interval=5)
    attempts: list[float] = []

    @bus.handler(retry=policy)
    async def handle(msg: Ping, ctx: Context) -> None:
        attempts.append(time.monotonic())
        raise RuntimeError(f"boom {ctx.retry_count}")

    async with bus:
        await bus.send(Ping(n=1), to="billing")
        await wait_until(lambda: len(attempts), until=lambda n: n >= 1, timeout=10, interval=0.01)
        # The failed attempt committed: the row is out of I.
        await wait_until("SELECT subqueue FROM nmbus.billing", db=db, until=lambda sq: sq != "I")
        (row,) = await rows(db)
        assert row["subqueue"] == "R"
        assert row["retry_count"] == 1
        assert row["error_info"].startswith("RuntimeError: boom 1\n")
        assert row["retry_time"] > row["last_processed"]
        await wait_until(
            lambda: rows(db), until=lambda found: found[0]["subqueue"] == "F", timeout=10
        )
    (row,) = await rows(db)
    assert row["retry_count"] == 3
    assert row["error_info"].startswith("RuntimeError: boom 3")
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    # 0.2 s then 0.4 s, woken by the timer for the next due row, not the 5 s poll.
    assert 0.18 < gaps[0] < 1.0 and 0.38 < gaps[1] < 1.2, gaps


async def test_permanent_error_and_retry_later(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing")

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        if msg.n == 1:
            raise PermanentError("card declined")
        raise RetryLater(seconds=30, reason="bank closed")

    async with bus:
        await bus.send(Ping(n=1), to="billing")
        await bus.send(Ping(n=2), to="billing")
        await drain(bus)
    failed, later = await rows(db)
    assert failed["subqueue"] == "F" and failed["retry_count"] == 1
    assert failed["error_info"].startswith("PermanentError: card declined")
    assert later["subqueue"] == "R" and later["retry_count"] == 0  # not counted as a failure
    wait = (later["retry_time"] - later["last_processed"]).total_seconds()
    assert 29 < wait <= 30.5


async def test_a_worker_killed_mid_handler_loses_nothing(
    dsn: str, make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    await db.execute("CREATE TABLE effects (n int, pid int)")
    doomed = Proc("worker", dsn, "billing", "1.0")
    try:
        await doomed.wait_for("ready")
        async with make_bus("orders", concurrency=0) as sender:
            await sender.send(Slow(n=7), to="billing")
        await doomed.wait_for("started 7")
        doomed.kill()
    finally:
        doomed.kill()
    (row,) = await rows(db)
    assert row["subqueue"] == "I" and row["retry_count"] == 1  # the lost attempt counted

    bus = make_bus("billing", lease_seconds=1.0, poll_interval=0.3)
    handled: list[int] = []

    @bus.handler
    async def handle(msg: Slow, ctx: Context) -> None:
        handled.append(ctx.retry_count)

    async with bus:
        await wait_until(lambda: handled, timeout=10)
        await drain(bus)
    assert handled == [2]
    (row,) = await rows(db)
    assert row["subqueue"] == "X" and row["retry_count"] == 2


async def test_a_message_that_kills_every_worker_ends_in_f(
    dsn: str, make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    await db.execute("CREATE TABLE effects (n int, pid int)")
    async with make_bus("orders", concurrency=0) as sender:
        await sender.send(Crash(n=1), to="billing")
        await sender.send(Ping(n=2), to="billing")
    crashes = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        (crash_row, _) = await rows(db)
        if crash_row["subqueue"] == "F":
            break
        proc = Proc("worker", dsn, "billing", "1.0")  # the shortest lease accepted
        try:
            proc.popen.wait(20)
        except subprocess.TimeoutExpired:
            pass
        finally:
            proc.kill()
        if any(line.startswith("crashing") for line in proc.lines):
            crashes += 1
    crash_row, ping_row = await rows(db)
    # max_attempts=3 in tests/workers.py: three attempts died, the fourth claim fails it.
    assert crashes == 3
    assert crash_row["subqueue"] == "F"
    assert crash_row["error_info"].startswith("AttemptsExhausted")
    assert ping_row["subqueue"] == "X"
    assert await db.fetchval("SELECT count(*) FROM effects WHERE n = 2") == 1


# -- 5. bad input never stops a worker ------------------------------------------------------


async def test_bad_input_goes_to_f_and_the_worker_carries_on(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing")
    seen: list[int] = []

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)

    async with bus:
        insert = (
            "INSERT INTO nmbus.billing (from_endpoint, to_endpoint, label, msg_text, unique_id) "
            "VALUES ('x', 'billing', $1, $2, $3)"
        )
        await db.execute(insert, "test.Ping", "{not json", "u1")
        await db.execute(insert, "test.Ping", '{"n": "many"}', "u2")
        await db.execute(insert, "no.SuchType", "{}", "u3")
        await db.execute(insert, "test.Pong", '{"n": 1}', "u4")
        await db.execute(insert, None, None, "u5")
        await bus.send(Ping(n=9), to="billing")
        await drain(bus)
    result = {r["unique_id"]: (r["subqueue"], (r["error_info"] or "")) for r in await rows(db)}
    assert result["u1"][0] == "F" and result["u1"][1].startswith("UndecodableMessage:")
    assert result["u2"][0] == "F" and "valid integer" in result["u2"][1]
    assert result["u3"] == (
        "F",
        "UnknownMessageType: no message type 'no.SuchType' is known to endpoint 'billing'",
    )
    assert result["u4"] == ("F", "NoHandler: endpoint 'billing' has no handler for 'test.Pong'")
    assert result["u5"][0] == "F"
    assert seen == [9]


async def test_unknown_types_can_be_skipped(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", on_unknown="skip")

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        pass

    async with bus:
        await bus.send(Pong(n=1), to="billing")
        await drain(bus)
    (row,) = await rows(db)
    assert row["subqueue"] == "X"
    assert row["error_info"].startswith("skipped: NoHandler")


# -- 6. graceful shutdown -------------------------------------------------------------------


async def test_shutdown_finishes_in_flight_and_returns_the_rest(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", batch_size=10, concurrency=1)  # one message in flight
    started = asyncio.Event()
    finished: list[int] = []

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        started.set()
        await asyncio.sleep(0.3)
        finished.append(msg.n)

    await bus.start()
    for n in range(10):
        await bus.send(Ping(n=n), to="billing")
    await asyncio.wait_for(started.wait(), 10)
    await bus.stop()
    assert finished == [0]
    states = [(r["subqueue"], r["retry_count"], r["handling_client_id"]) for r in await rows(db)]
    assert states[0] == ("X", 1, None)
    assert states[1:] == [("I", 0, None)] * 9


async def test_shutdown_timeout_cancels_a_hung_handler_and_frees_its_batch(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", shutdown_timeout=0.3, lease_seconds=60, batch_size=10)
    started = asyncio.Event()

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        started.set()
        await asyncio.sleep(3600)

    async with make_bus("orders", concurrency=0) as sender:
        for n in range(3):
            await sender.send(Ping(n=n), to="billing")
    await bus.start()
    await asyncio.wait_for(started.wait(), 10)
    t0 = time.monotonic()
    await bus.stop()
    assert time.monotonic() - t0 < 3
    states = [
        (r["subqueue"], r["retry_count"], r["handling_client_id"], r["lease_expires"])
        for r in await rows(db)
    ]
    # The hung one did start: its attempt counts. Its batch-mates never did.
    assert states == [("I", 1, None, None), ("I", 0, None, None), ("I", 0, None, None)]


# -- scheduling and wake-ups ------------------------------------------------------------


async def test_deliver_at_is_not_early_and_about_on_time(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", poll_interval=30)
    handled_at: list[datetime] = []

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        handled_at.append(datetime.now(UTC))

    async with bus:
        when = datetime.now(UTC) + timedelta(seconds=1.5)
        await bus.send(Ping(n=1), to="billing", deliver_at=when)
        (row,) = await rows(db)
        assert row["subqueue"] == "R"
        await wait_until(lambda: handled_at, timeout=10, interval=0.01)
    assert when <= handled_at[0] < when + timedelta(seconds=1)


async def test_listen_wakes_the_worker_long_before_the_poll(
    make_bus: Callable[..., Bus],
) -> None:
    bus = make_bus("billing", poll_interval=30)
    delays: list[float] = []
    sent: dict[int, float] = {}

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        delays.append(time.perf_counter() - sent[msg.n])

    async with bus, make_bus("orders", concurrency=0) as sender:
        await asyncio.sleep(0.3)  # the worker is idle, waiting
        for n in range(5):
            sent[n] = time.perf_counter()
            await sender.send(Ping(n=n), to="billing")
            await asyncio.sleep(0.1)
        await drain(bus)
    assert len(delays) == 5
    assert max(delays) < 0.5, delays  # the fallback poll is 30 s


# -- API details ---------------------------------------------------------------------------


async def test_class_chain_dispatch_correlation_headers_and_reply(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing")
    calls: list[tuple[str, str | None, dict[str, str]]] = []

    @bus.handler
    async def on_event(msg: Event, ctx: Context) -> None:
        calls.append(("event", ctx.correlation_id, dict(ctx.headers)))

    @bus.handler
    async def on_order(msg: OrderPlaced, ctx: Context) -> None:
        calls.append(("order", ctx.correlation_id, dict(ctx.headers)))
        await ctx.reply(Pong(n=msg.order_id))

    async with bus, make_bus("orders", concurrency=0) as sender:
        await sender.send(
            OrderPlaced(name="o", order_id=5),
            to="billing",
            correlation_id="corr-1",
            headers={"tenant": 'ü-1 "quoted"'},
        )
        await drain(bus)
    assert calls == [
        ("order", "corr-1", {"tenant": 'ü-1 "quoted"'}),
        ("event", "corr-1", {"tenant": 'ü-1 "quoted"'}),
    ]
    (reply,) = await rows(db, "orders")
    assert (reply["label"], reply["msg_text"]) == ("test.Pong", '{"n":5}')
    assert (reply["from_endpoint"], reply["correlation_id"]) == ("billing", "corr-1")


async def test_structlog_binds_message_fields_for_the_handler(
    make_bus: Callable[..., Bus],
) -> None:
    import structlog

    bus = make_bus("billing", max_attempts=1)
    handler_log = structlog.get_logger("app")

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        handler_log.info("charging", amount=msg.n)
        raise ValueError("no money")

    with structlog.testing.capture_logs(
        processors=[structlog.contextvars.merge_contextvars]
    ) as logs:
        async with bus:
            await bus.send(Ping(n=3), to="billing")
            await drain(bus)
    charging = next(e for e in logs if e["event"] == "charging")
    failed = next(e for e in logs if e["event"] == "message_failed")
    for entry in (charging, failed):
        assert entry["queue"] == "billing"
        assert entry["message_type"] == "test.Ping"
        assert isinstance(entry["message_id"], int)
    assert failed["error"] == "ValueError: no money"
