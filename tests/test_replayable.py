"""Handlers without outside effects: batches without savepoints, replayed on failure.

``@bus.handler(outside_effects=False)`` declares that a handler's only effects
go through ``ctx.connection``, ``ctx.send`` and ``ctx.publish``. Its batches
run without a savepoint per message; when one fails after writing, the batch
is rolled back and run again with savepoints, the failure standing. What must
hold: every other message's effects and sends commit exactly once, the failed
one's never, its outcome is the usual R or F, and a handler that may have
effects elsewhere is never run twice by a replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace
from typing import cast

import asyncpg
import pytest

from nmbus import Bus, Context, HandlerError
from nmbus.envelopes import IN_REPLY_TO_HEADER
from nmbus.messages import StoredMessage
from nmbus.received import Received
from nmbus.testing import drain
from tests.messages import Ping, Pong
from tests.waits import wait_until


async def _send(bus: Bus, messages: list[Ping | Pong]) -> None:
    async with Bus("sender", dsn=bus.settings.dsn, concurrency=0) as sender:
        for message in messages:
            await sender.send(message, to="billing")


async def test_a_failure_after_writing_rolls_back_only_its_own_effects(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    await db.execute("CREATE TABLE effects (n int PRIMARY KEY)")
    bus = make_bus("billing", batch_size=20, max_attempts=1)
    runs: Counter[int] = Counter()

    @bus.handler(outside_effects=False)
    async def handle(msg: Ping, ctx: Context) -> None:
        runs[msg.n] += 1
        await ctx.connection.execute("INSERT INTO effects (n) VALUES ($1)", msg.n)
        await ctx.send(Pong(n=msg.n), to="replies")
        if msg.n % 4 == 1:
            raise ValueError("fails after its write")
        if msg.n % 4 == 2:
            # A statement fails and the handler swallows it: the transaction is
            # aborted, so this message fails, and no other.
            with contextlib.suppress(asyncpg.UniqueViolationError):
                await ctx.connection.execute("INSERT INTO effects (n) VALUES ($1)", msg.n)

    await _send(bus, [Ping(n=n) for n in range(12)])
    async with bus:
        await drain(bus, timeout=30)
    good = [n for n in range(12) if n % 4 in (0, 3)]
    effects = [r["n"] for r in await db.fetch("SELECT n FROM effects ORDER BY n")]
    assert effects == good
    sent = await db.fetch('SELECT msg_text FROM nmbus."replies" ORDER BY id')
    assert sorted(Pong.model_validate_json(r["msg_text"]).n for r in sent) == good
    states = await db.fetch(
        'SELECT subqueue, retry_count, error_info FROM nmbus."billing" ORDER BY id'
    )
    assert [r["subqueue"] for r in states] == ["X", "F", "F", "X"] * 3
    assert all(r["retry_count"] == 1 for r in states)
    assert states[1]["error_info"].startswith("ValueError: fails after its write")
    assert "InFailedSQLTransaction" in states[2]["error_info"]
    # A message that failed after writing is not run again in the replay.
    assert all(runs[n] == 1 for n in range(12) if n % 4 == 1)
    assert bus.worker.replays >= 1


async def test_a_failed_message_is_retried_as_usual_and_commits_once(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    await db.execute("CREATE TABLE effects (n int, attempt int)")
    bus = make_bus("billing", batch_size=10, max_attempts=3, retry_delay=0.0)

    @bus.handler(outside_effects=False)
    async def handle(msg: Ping, ctx: Context) -> None:
        await ctx.connection.execute(
            "INSERT INTO effects (n, attempt) VALUES ($1, $2)", msg.n, ctx.retry_count
        )
        if msg.n == 4 and ctx.retry_count < 3:
            raise RuntimeError("not yet")

    await _send(bus, [Ping(n=n) for n in range(8)])
    async with bus:
        await drain(bus, timeout=30)
    rows = await db.fetch("SELECT n, attempt FROM effects ORDER BY n")
    assert [(r["n"], r["attempt"]) for r in rows] == [(n, 3 if n == 4 else 1) for n in range(8)]
    states = await db.fetch('SELECT subqueue, retry_count FROM nmbus."billing" ORDER BY id')
    assert [tuple(r) for r in states] == [("X", 3 if n == 4 else 1) for n in range(8)]


async def test_a_replay_never_reruns_a_handler_with_outside_effects(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # A batch holding a message whose handler may have effects elsewhere runs
    # with savepoints: a failure then undoes only its own handler's writes.
    await db.execute("CREATE TABLE effects (n int)")
    bus = make_bus("billing", batch_size=20, max_attempts=1)
    calls: Counter[int] = Counter()

    @bus.handler(outside_effects=False)
    async def pure(msg: Ping, ctx: Context) -> None:
        await ctx.connection.execute("INSERT INTO effects (n) VALUES ($1)", msg.n)
        if msg.n == 3:
            raise ValueError("fails after its write")

    @bus.handler
    async def outside(msg: Pong, ctx: Context) -> None:
        calls[msg.n] += 1  # stands for an HTTP call: must happen once
        await ctx.connection.execute("INSERT INTO effects (n) VALUES ($1)", 100 + msg.n)

    await _send(bus, [Pong(n=1), Ping(n=2), Ping(n=3), Pong(n=4), Ping(n=5)])
    async with bus:
        await drain(bus, timeout=30)
    assert calls == Counter({1: 1, 4: 1})
    assert bus.worker.replays == 0
    effects = sorted(r["n"] for r in await db.fetch("SELECT n FROM effects"))
    assert effects == [2, 5, 101, 104]


async def test_batches_of_only_replayable_handlers_take_no_savepoint(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    await db.execute("CREATE TABLE effects (n int, savepoints int)")
    bus = make_bus("billing", batch_size=10)

    @bus.handler(outside_effects=False)
    async def handle(msg: Ping, ctx: Context) -> None:
        # A savepoint would show as a subtransaction id; without one the row's
        # xmin is the batch's own top-level transaction for every message.
        await ctx.connection.execute("INSERT INTO effects (n, savepoints) VALUES ($1, 0)", msg.n)

    await _send(bus, [Ping(n=n) for n in range(10)])
    async with bus:
        await drain(bus, timeout=30)
    xmins = await db.fetch("SELECT DISTINCT xmin::text FROM effects")
    assert len(xmins) == 1  # one transaction, no subtransactions
    assert bus.worker.replays == 0


def test_outside_effects_must_be_a_bool(make_bus: Callable[..., Bus]) -> None:
    bus = make_bus("billing")
    with pytest.raises(HandlerError, match="outside_effects must be True or False"):

        @bus.handler(outside_effects="no")  # type: ignore[arg-type]
        async def handle(msg: Ping, ctx: Context) -> None:
            pass


async def test_a_batch_holding_a_reply_keeps_its_savepoints(make_bus: Callable[..., Bus]) -> None:
    # A reply is handed to the request waiting for it while its batch runs; a
    # replay could not take that back, so such a batch is never run unguarded.
    bus = make_bus("billing")

    @bus.handler(outside_effects=False)
    async def handle(msg: Ping, ctx: Context) -> None:
        pass

    def row(headers: dict[str, str]) -> Received:
        # The worker decodes each claimed row once; the batch is judged on that.
        return Received(
            cast(
                StoredMessage,
                SimpleNamespace(label=Ping.__type_name__, msg_headers=json.dumps(headers)),
            )
        )

    plain = [row({}), row({"x": "1"})]
    assert bus.worker.batches.replayable(plain)
    assert not bus.worker.batches.replayable([*plain, row({IN_REPLY_TO_HEADER: "42"})])


async def test_a_stop_during_a_replay_keeps_the_failure_that_caused_it(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # The worker is asked to stop while the batch is being rolled back: the
    # messages not yet run go back to I with their attempt refunded, but the
    # one that failed after writing did run, so its failure and attempt stand.
    await db.execute("CREATE TABLE effects (n int)")
    bus = make_bus("billing", batch_size=10, max_attempts=1)
    stopping: list[asyncio.Task[None]] = []

    @bus.handler(outside_effects=False)
    async def handle(msg: Ping, ctx: Context) -> None:
        await ctx.connection.execute("INSERT INTO effects (n) VALUES ($1)", msg.n)
        if msg.n == 2:
            stopping.append(asyncio.create_task(bus.worker.stop()))
            raise ValueError("fails after its write")

    await _send(bus, [Ping(n=n) for n in range(1, 4)])
    async with bus:
        await wait_until(lambda: stopping, interval=0.01)
        await asyncio.wait_for(stopping[0], 30)
    states = await db.fetch(
        'SELECT subqueue, retry_count, error_info FROM nmbus."billing" ORDER BY id'
    )
    assert [(r["subqueue"], r["retry_count"]) for r in states] == [("I", 0), ("F", 1), ("I", 0)]
    assert states[1]["error_info"].startswith("ValueError: fails after its write")
    assert await db.fetchval("SELECT count(*) FROM effects") == 0
