"""Defects found by trying to break the released bus, one test each (worker side).

Each test failed before its fix. See docs/reliability.md for the catalogue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest
from structlog.testing import capture_logs

from nmbus import Bus, Context, Message
from nmbus.testing import drain
from tests.messages import Ping
from tests.waits import wait_until


class Weird(Message, type_name="test.hardening.Weird"):
    kind: str


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


class NotAnException(BaseException):
    """A BaseException that is not an Exception, as some libraries raise."""


async def rows(db: asyncpg.Connection, queue: str = "billing") -> list[asyncpg.Record]:
    return await db.fetch(
        f'SELECT subqueue, retry_count, error_info, msg_text FROM nmbus."{queue}" ORDER BY id'
    )


def assert_loops_alive(bus: Bus) -> None:
    tasks = bus.worker._tasks
    assert tasks and not any(t.done() for t in tasks)


# -- 2. a handler's CancelledError or BaseException stops no loop --------------------


async def test_a_stray_cancellation_fails_the_attempt_and_the_loops_go_on(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", concurrency=2, batch_size=1, max_attempts=2, retry_delay=30)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        if msg.n < 2:
            victim = asyncio.create_task(asyncio.sleep(10))
            await asyncio.sleep(0)
            victim.cancel()
            await victim  # someone else cancelled it: CancelledError lands here
        if msg.n == 2:
            raise NotAnException("not an Exception at all")

    async with bus:
        for n in range(3):
            await bus.send(Ping(n=n), to="billing")
        await drain(bus)
        assert_loops_alive(bus)
        await bus.send(Ping(n=7), to="billing")
        await drain(bus)
        assert_loops_alive(bus)
    first, second, third, fourth = await rows(db)
    for row in (first, second):
        assert row["subqueue"] == "R" and row["retry_count"] == 1
        assert row["error_info"].startswith("HandlerCancelled: ")
        assert "CancelledError" in row["error_info"]
    assert third["subqueue"] == "R"
    assert third["error_info"].startswith("NotAnException: not an Exception at all")
    assert fourth["subqueue"] == "X"


async def test_a_cancellation_in_concurrent_handlers_fails_only_its_message(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", handler_concurrency=4, max_attempts=1)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        await asyncio.sleep(0.01)
        if msg.n == 1:
            raise asyncio.CancelledError

    async with bus:
        for n in range(4):
            await bus.send(Ping(n=n), to="billing")
        await drain(bus)
        assert_loops_alive(bus)
    assert [r["subqueue"] for r in await rows(db)] == ["X", "F", "X", "X"]


async def test_a_side_task_that_dies_is_logged_and_restarted(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", poll_interval=30.0)
    store: Any = bus.store
    real_listen = store.listen
    calls = 0

    async def flaky_listen(on_wakeup: Callable[[str], None], *args: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("listener bug")
        await real_listen(on_wakeup, *args)

    store.listen = flaky_listen
    handled = asyncio.Event()

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        handled.set()

    with capture_logs() as logs:
        async with bus:
            await wait_until(lambda: calls, until=lambda n: n >= 2, timeout=10, interval=0.02)
            await asyncio.sleep(0.3)  # the restarted listener is connected
            await bus.send(Ping(n=1), to="billing")
            # Woken by the restarted listener, not by the 30 s poll.
            async with asyncio.timeout(5):
                await handled.wait()
    failures = [e for e in logs if e["event"] == "background_task_failed"]
    assert [(e["task"], e["error"]) for e in failures] == [
        ("listener", "RuntimeError: listener bug")
    ]


# -- 3. an outcome that cannot be written loses no real error ----------------------


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("nul", "ValueError: bad\\x00byte"),
        ("surrogate", "ValueError: lone \\ud800 half"),
        ("unprintable", "Unprintable: <str() of this Unprintable failed>"),
    ],
)
async def test_an_unstorable_error_text_is_stored_readably(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, kind: str, expected: str
) -> None:
    bus = make_bus("billing", max_attempts=3, retry_delay=60)

    @bus.handler
    async def handle(msg: Weird, ctx: Context) -> None:
        if msg.kind == "nul":
            raise ValueError("bad\x00byte")
        if msg.kind == "surrogate":
            raise ValueError("lone \ud800 half")
        if msg.kind == "unprintable":
            raise Unprintable
        await ctx.connection.execute("SELECT 1")

    async with bus:
        await bus.send(Weird(kind=kind), to="billing")
        await bus.send(Weird(kind="fine"), to="billing")
        await drain(bus)
    bad, fine = await rows(db)
    # Scheduled by the policy (60 s), attempt counted once: not re-claimed at once.
    assert bad["subqueue"] == "R" and bad["retry_count"] == 1
    assert bad["error_info"].splitlines()[0] == expected
    assert fine["subqueue"] == "X"


async def test_a_batch_whose_commit_fails_is_retried_with_backoff_and_its_error(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # A deferred constraint fails only at COMMIT, after every handler succeeded.
    await db.execute("CREATE TABLE once (n int UNIQUE DEFERRABLE INITIALLY DEFERRED)")
    await db.execute("INSERT INTO once VALUES (1)")
    bus = make_bus("billing", max_attempts=3, retry_delay=60)
    runs: list[int] = []

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        runs.append(msg.n)
        await ctx.connection.execute("INSERT INTO once VALUES ($1)", msg.n)

    async with make_bus("orders", concurrency=0) as sender:
        for n in (1, 2, 3):
            await sender.send(Ping(n=n), to="billing")
    async with bus:
        await drain(bus)
    first, second, third = await rows(db)
    assert first["subqueue"] == "R" and first["retry_count"] == 1
    assert first["error_info"].startswith(
        "OutcomeNotRecorded: batch transaction: UniqueViolationError: duplicate key"
    )
    assert second["subqueue"] == third["subqueue"] == "X"
    # The batch ran once, then each message alone: never the same one over and over.
    assert runs.count(1) == 2


# -- 9. one hand-written row harms only itself -------------------------------------


async def test_a_row_with_a_huge_retry_count_does_not_stall_the_queue(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", max_attempts=3)
    seen: list[int] = []

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)
        if msg.n == 1:
            raise ValueError("fails once more")

    async with make_bus("orders", concurrency=0) as sender:
        await sender.send(Ping(n=1), to="billing")
        await sender.send(Ping(n=2), to="billing")
    await db.execute("UPDATE nmbus.billing SET retry_count = 2147483647 WHERE id = 1")
    async with bus:
        await drain(bus)
    first, second = await rows(db)
    assert first["subqueue"] == "F" and first["error_info"].startswith("ValueError")
    assert second["subqueue"] == "X"
    assert sorted(seen) == [1, 2]


async def test_a_row_scheduled_for_infinity_is_never_due_and_breaks_nothing(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", poll_interval=0.2)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        pass

    async with make_bus("orders", concurrency=0) as sender:
        await sender.send(Ping(n=1), to="billing")
    await db.execute("UPDATE nmbus.billing SET subqueue = 'R', retry_time = 'infinity'")
    with capture_logs() as logs:
        async with bus:
            await asyncio.sleep(1.0)  # several idle cycles, each asking what is due next
            await bus.send(Ping(n=2), to="billing")
            await drain(bus)
    assert [e for e in logs if e["log_level"] in ("error", "warning")] == []
    never, handled = await rows(db)
    assert never["subqueue"] == "R" and handled["subqueue"] == "X"


# -- quiet by default ----------------------------------------------------------------


async def test_an_unconfigured_structlog_gets_no_line_per_message(
    make_bus: Callable[..., Bus], capsys: pytest.CaptureFixture[str]
) -> None:
    import structlog

    structlog.reset_defaults()
    assert not structlog.is_configured()
    bus = make_bus("billing", max_attempts=1)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        if msg.n % 2:
            raise ValueError("odd")

    async with bus:
        for n in range(40):
            await bus.send(Ping(n=n), to="billing")
        await drain(bus)
    out = capsys.readouterr()
    lines = (out.out + out.err).splitlines()
    per_message = [line for line in lines if "message_" in line]
    assert per_message == []
    assert len(lines) < 10  # start, stop and the like; not one per message
