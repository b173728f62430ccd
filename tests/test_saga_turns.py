"""The loops of a process take turns under saga contention (nmbus/consume/worker.py,
nmbus/consume/turns.py; docs/sagas.md, "Several loops and processes"): once a batch
has found one of its sagas held by another process's, the process's loops claim
and run one batch at a time: the loop that has the turn keeps it while its
batches are short, and no batch keeps another loop waiting longer than
TURN_SECONDS.
On a real PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import asyncpg
import pytest

from nmbus import Bus, Context, Message, Saga
from nmbus.consume import turns as turns_module
from nmbus.consume.batch import BatchRunner
from nmbus.sagas import locks as saga_locks_module
from nmbus.testing import drain
from tests.saga_holds import WAITING_FOR_A_LOCK, held_elsewhere
from tests.saga_workers import Counter, Increment
from tests.waits import wait_until


class Plain(Message, type_name="test.saga_turns.Plain"):
    n: int


async def _contended(bus: Bus, db: asyncpg.Connection, dsn: str) -> None:
    """A batch of the bus finds saga "x" held by another process's transaction (and
    waits for it until that commits): the endpoint meets contention."""
    async with held_elsewhere(dsn, "Counter", "x"):
        await bus.send(Increment(counter="x", n=-1), to="counting")
        await wait_until(WAITING_FOR_A_LOCK, db=db, until=lambda n: n == 1, timeout=20)
    await drain(bus, timeout=20)


async def _send_in_one(bus: Bus, dsn: str, messages: list[Message]) -> None:
    """The messages in one transaction: both loops find a backlog at once."""
    sender = await asyncpg.connect(dsn)
    try:
        async with sender.transaction():
            for message in messages:
                await bus.send(message, to="counting", connection=sender)
    finally:
        await sender.close()


def _contended_turns(
    make_bus: Callable[..., Bus],
    monkeypatch: pytest.MonkeyPatch,
    turn_seconds: float = 0.5,
    **settings: Any,
) -> tuple[Bus, Saga[Counter]]:
    """Two loops whose contention, once met, lasts a minute, and whose turn a batch
    keeps from the other loop for ``turn_seconds`` at most; the endpoint's Counter saga."""
    monkeypatch.setattr(saga_locks_module, "CONTENDED_SECONDS", 60.0)
    monkeypatch.setattr(turns_module, "TURN_SECONDS", turn_seconds)
    bus = make_bus("counting", concurrency=2, **settings)
    return bus, bus.saga(Counter, key="counter")


async def test_under_contention_the_loops_of_a_process_run_one_batch_at_a_time(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    running: list[int] = []
    most: list[int] = [0]
    run_batch = BatchRunner._run_batch_once

    async def counted(self: BatchRunner, *args: Any, **kwargs: Any) -> Any:
        running.append(1)
        most[0] = max(most[0], len(running))
        try:
            return await run_batch(self, *args, **kwargs)
        finally:
            running.pop()

    monkeypatch.setattr(BatchRunner, "_run_batch_once", counted)
    bus, saga = _contended_turns(
        make_bus, monkeypatch, turn_seconds=60.0, batch_size=5, poll_interval=0.2
    )

    @saga.handler(start=True)
    async def count(msg: Increment, state: Counter, ctx: Context) -> None:
        await asyncio.sleep(0.01)
        state.count += 1
        state.seen.append(msg.n)

    def backlog(start: int) -> list[Message]:
        return [Increment(counter=f"c{n % 4}", n=n) for n in range(start, start + 40)]

    async with bus:
        # Uncontended: both loops claim, one batch waits for the other's sagas in
        # memory, as before.
        await _send_in_one(bus, dsn, backlog(0))
        await drain(bus, timeout=30)
        assert most[0] == 2
        await _contended(bus, db, dsn)
        most[0] = 0
        await _send_in_one(bus, dsn, backlog(40))
        await drain(bus, timeout=30)
        states = [await saga.load(f"c{k}") for k in range(4)]
    # Contended: one batch of the process at a time; every message counted once, and
    # each saga saw its messages in send order.
    assert most[0] == 1
    for k, state in enumerate(states):
        assert state is not None
        assert state.seen == [n for n in range(80) if n % 4 == k]


async def test_under_contention_the_loop_that_has_the_turn_keeps_it_from_batch_to_batch(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Passed from loop to loop after every batch, the turn cost a sixth of the
    # throughput (docs/performance.md, "a tenth sitting"): the loop that has it keeps
    # it while its batches are short, and the other loop waits, for longer than
    # TURN_SECONDS in all (each batch of the holder's counts afresh).
    loops: list[int] = []  # the session (one per loop) of each batch
    times: list[float] = []
    run_batch = BatchRunner._run_batch_once

    async def noted(self: BatchRunner, session: Any, *args: Any, **kwargs: Any) -> Any:
        loops.append(id(session))
        times.append(time.monotonic())
        return await run_batch(self, session, *args, **kwargs)

    monkeypatch.setattr(BatchRunner, "_run_batch_once", noted)
    turn = 0.5
    bus, saga = _contended_turns(
        make_bus, monkeypatch, turn_seconds=turn, batch_size=5, poll_interval=0.2
    )

    @saga.handler(start=True)
    async def count(msg: Increment, state: Counter, ctx: Context) -> None:
        await asyncio.sleep(0.01)  # a batch of 5: about a tenth of TURN_SECONDS
        state.count += 1

    async with bus:
        await _contended(bus, db, dsn)
        loops.clear()
        times.clear()
        await _send_in_one(bus, dsn, [Increment(counter=f"c{n % 4}", n=n) for n in range(150)])
        await drain(bus, timeout=60)
        states = [await saga.load(f"c{k}") for k in range(4)]
    assert len(loops) >= 30  # batches of 5
    assert times[-1] - times[0] > 2 * turn
    assert len(set(loops)) == 1
    assert sum(state.count for state in states if state is not None) == 150


async def test_a_batch_keeps_the_turn_from_the_other_loops_for_at_most_a_while(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under contention, one loop's batch runs a handler that takes long. The other
    # loop waits for its turn at most TURN_SECONDS from when that batch took it, then
    # claims without it: a message sent meanwhile is handled while the long one runs.
    bus, saga = _contended_turns(make_bus, monkeypatch, batch_size=5, poll_interval=0.2)
    long_started, release = asyncio.Event(), asyncio.Event()
    handled: dict[int, float] = {}

    @saga.handler(start=True)
    async def count(msg: Increment, state: Counter, ctx: Context) -> None:
        state.count += 1

    @bus.handler
    async def plain(msg: Plain, ctx: Context) -> None:
        if msg.n == 0:
            long_started.set()
            await release.wait()
        handled[msg.n] = time.monotonic()

    async with bus:
        await _contended(bus, db, dsn)
        await bus.send(Plain(n=0), to="counting")
        await asyncio.wait_for(long_started.wait(), 20)
        await bus.send(Plain(n=1), to="counting")
        await wait_until(lambda: 1 in handled, timeout=20, what="the second message handled")
        assert 0 not in handled  # the long handler still runs
        release.set()
        await drain(bus, timeout=20)


async def test_a_batch_claimed_with_a_finish_runs_at_once_not_after_newer_messages(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under contention, loop A's batch blocks on Plain 0; after TURN_SECONDS loop B
    # claims 1-5 without the turn, and (leased) its finish claims the next batch.
    # That batch must run then, not wait for the turn while A, keeping it, drains
    # the whole backlog of newer messages (saga "k" would see them out of order).
    bus, saga = _contended_turns(make_bus, monkeypatch, batch_size=5, poll_interval=0.2)
    long_started, release, b_started, a_going = (asyncio.Event() for _ in range(4))

    @saga.handler(start=True)
    async def count(msg: Increment, state: Counter, ctx: Context) -> None:
        a_going.set()
        await asyncio.sleep(0.01)
        state.count += 1
        state.seen.append(msg.n)

    @bus.handler
    async def plain(msg: Plain, ctx: Context) -> None:
        if msg.n == 0:
            long_started.set()
            await release.wait()
        elif msg.n == 1:
            b_started.set()
            await asyncio.wait_for(a_going.wait(), 20)

    async with bus:
        await _contended(bus, db, dsn)
        a_going.clear()
        await bus.send(Plain(n=0), to="counting")
        await asyncio.wait_for(long_started.wait(), 20)
        backlog: list[Message] = [Plain(n=n) for n in range(1, 6)]
        await _send_in_one(bus, dsn, backlog + [Increment(counter="k", n=n) for n in range(6, 200)])
        await asyncio.wait_for(b_started.wait(), 20)
        release.set()
        await drain(bus, timeout=60)
        state = await saga.load("k")
    assert state is not None
    assert state.seen == list(range(6, 200))


async def test_a_loop_that_has_just_given_the_turn_back_waits_for_it_at_most_a_while(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under contention, batches of one message: one loop runs "a" with the turn
    # while the other waits for it. Then "slow", which blocks, runs with the turn,
    # whichever loop has it (kept by the loop that ran "a", or given back and taken
    # by the other while the first asks again). The loop without it waits at most
    # TURN_SECONDS from the start of that batch, then claims without it: a message
    # sent meanwhile is handled while "slow" still blocks.
    bus, saga = _contended_turns(make_bus, monkeypatch, batch_size=1, poll_interval=30)
    slow_started, release = asyncio.Event(), asyncio.Event()
    handled: list[int] = []

    @saga.handler(start=True)
    async def count(msg: Increment, state: Counter, ctx: Context) -> None:
        if msg.counter == "a":
            await asyncio.sleep(0.1)
        if msg.counter == "slow":
            slow_started.set()
            await release.wait()
        state.count += 1

    @bus.handler
    async def plain(msg: Plain, ctx: Context) -> None:
        handled.append(msg.n)

    async with bus:
        await _contended(bus, db, dsn)
        await _send_in_one(bus, dsn, [Increment(counter="a", n=1), Increment(counter="slow", n=2)])
        await asyncio.wait_for(slow_started.wait(), 20)
        await bus.send(Plain(n=1), to="counting")
        try:
            await wait_until(lambda: handled == [1], timeout=10, what="the plain message handled")
            assert not release.is_set()
        finally:
            release.set()
        await drain(bus, timeout=20)


async def test_a_loop_without_the_turn_claims_nothing_ahead(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under contention, loop A's batch blocks on Plain 0 past TURN_SECONDS, so loop B
    # runs batches of the backlog without the turn. B's finishes claim nothing ahead:
    # once A's batch is done (A keeps the turn from then on), B runs no more than the
    # batch it had begun. Claiming ahead, it would go on beside A, batch after batch,
    # while the backlog lasted.
    loop_of: ContextVar[int] = ContextVar("loop_of")  # the session (one per loop) of a batch
    run_batch = BatchRunner._run_batch_once

    async def noted(self: BatchRunner, session: Any, *args: Any, **kwargs: Any) -> Any:
        loop_of.set(id(session))
        return await run_batch(self, session, *args, **kwargs)

    monkeypatch.setattr(BatchRunner, "_run_batch_once", noted)
    bus, saga = _contended_turns(make_bus, monkeypatch, batch_size=5, poll_interval=0.2)
    long_started, release = asyncio.Event(), asyncio.Event()
    loop_a: list[int] = []

    @saga.handler(start=True)
    async def count(msg: Increment, state: Counter, ctx: Context) -> None:
        state.count += 1

    before: list[int] = []  # the loop of each message handled before A's batch ends
    after: list[int] = []

    @bus.handler
    async def plain(msg: Plain, ctx: Context) -> None:
        if msg.n == 0:
            loop_a.append(loop_of.get())
            long_started.set()
            await release.wait()
            return
        await asyncio.sleep(0.01)
        (after if release.is_set() else before).append(loop_of.get())

    async with bus:
        await _contended(bus, db, dsn)
        await bus.send(Plain(n=0), to="counting")
        await asyncio.wait_for(long_started.wait(), 20)
        await _send_in_one(bus, dsn, [Plain(n=n) for n in range(1, 301)])
        await wait_until(lambda: len(before), until=lambda n: n >= 10, timeout=20)
        release.set()
        await drain(bus, timeout=60)
    assert loop_a[0] not in before  # B ran without the turn while A's batch blocked
    assert len(after) >= 200  # a backlog was left when A's batch ended
    assert sum(loop != loop_a[0] for loop in after) <= 15  # B: the batch it had begun


async def test_a_batch_claimed_ahead_before_the_contention_runs_without_the_turn(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Loop B claims Plain 1-5 while there is no contention, so its finish will claim
    # the next batch. During its batch, loop A meets saga "x" held elsewhere: the
    # contention begins, and A, then holding the turn, drains saga "k"'s backlog.
    # When B's batch ends, the batch its finish claimed (older "k" messages than A's
    # next) runs at once, without the turn: waiting for it, it ran after the backlog,
    # and "k" saw its messages out of order.
    bus, saga = _contended_turns(make_bus, monkeypatch, batch_size=5, poll_interval=0.2)
    b_started, go = asyncio.Event(), asyncio.Event()

    @saga.handler(start=True)
    async def count(msg: Increment, state: Counter, ctx: Context) -> None:
        await asyncio.sleep(0.01)
        state.count += 1
        state.seen.append(msg.n)

    @bus.handler
    async def plain(msg: Plain, ctx: Context) -> None:
        if msg.n == 1:
            b_started.set()
            await go.wait()

    async with bus:
        await _send_in_one(bus, dsn, [Plain(n=n) for n in range(1, 6)])
        await asyncio.wait_for(b_started.wait(), 20)
        async with held_elsewhere(dsn, "Counter", "x"):
            await bus.send(Increment(counter="x", n=-1), to="counting")
            await wait_until(WAITING_FOR_A_LOCK, db=db, until=lambda n: n == 1, timeout=20)
            await _send_in_one(bus, dsn, [Increment(counter="k", n=n) for n in range(6, 200)])
        await wait_until(
            lambda: saga.load("k"),
            until=lambda state: state is not None and len(state.seen) >= 20,
            timeout=20,
            what="A draining saga k",
        )
        go.set()
        await drain(bus, timeout=60)
        state = await saga.load("k")
    assert state is not None
    assert state.seen == list(range(6, 200))
