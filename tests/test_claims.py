"""Each claim its own identity (nmbus/consume/claim.py), on a real PostgreSQL.

A lease names the claim that took it, not the process: every finish, renewal,
give-back and lease-lost decision matches on the claim's token, so a loop can
never finish, renew or free the rows another loop of its own process claimed
again. A claim owns what became of its rows, and ends with its batch: nothing
of it stays in flight after the batch is gone. A message whose claim's lease
may have lapsed is not started.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest

from nmbus import Bus, Context
from nmbus.postgres.session import PostgresBatch
from nmbus.testing import drain
from tests.messages import Ping
from tests.waits import wait_until


async def _backlog(make_bus: Callable[..., Bus], db: asyncpg.Connection, n: int) -> None:
    """Pings 0 to n - 1 in queue billing (created by a bus that then stops)."""
    async with make_bus("billing", concurrency=0):
        pass
    await db.execute(
        "INSERT INTO nmbus.billing (from_endpoint, to_endpoint, label, msg_text, msg_headers)"
        " SELECT 'sender', 'billing', 'test.Ping', json_build_object('n', g)::text, '{}'"
        " FROM generate_series(0, $1 - 1) AS g",
        n,
    )


async def _ready(db: asyncpg.Connection) -> int:
    return int(
        await db.fetchval(
            "SELECT count(*) FROM nmbus.billing WHERE subqueue IN ('I', 'R')"
            " OR handling_client_id IS NOT NULL"
        )
    )


async def test_a_blocked_event_loop_runs_no_innocent_message_twice(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # One process, two loops, leases of 2 s; every 50th handler blocks the whole
    # event loop for 4 s (time.sleep), so no lease is renewed meanwhile and the
    # blocked batch's claim lapses. The other loop may claim that batch's rows
    # again (as a crash's, under a claim of its own). The blocked batch then
    # starts none of the messages it had not started: its lease may have lapsed.
    # Its finish and its lease-lost decision name its own claim, so it takes
    # nothing from the other loop's run. Only the blocking message may run twice;
    # every transactional effect is there once.
    await db.execute("CREATE TABLE effects (n int)")
    bus = make_bus("billing", concurrency=2, lease_seconds=2.0, poll_interval=0.2)
    runs: list[tuple[int, int]] = []

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        runs.append((msg.n, ctx.retry_count))
        await ctx.connection.execute("INSERT INTO effects VALUES ($1)", msg.n)
        if msg.n % 50 == 25:
            time.sleep(4)  # blocks the event loop past the lease

    await _backlog(make_bus, db, 160)
    async with bus:
        await drain(bus, timeout=90)
    blockers = {25, 75, 125}
    counts = Counter(n for n, _ in runs)
    assert set(counts) == set(range(160))
    twice = {n: c for n, c in counts.items() if c > 1}
    assert set(twice) <= blockers and all(c == 2 for c in twice.values()), twice
    effects = Counter(r["n"] for r in await db.fetch("SELECT n FROM effects"))
    assert effects == Counter(range(160))  # exactly once, however often a message ran
    states = await db.fetch("SELECT subqueue, handling_client_id FROM nmbus.billing")
    assert {(r["subqueue"], r["handling_client_id"]) for r in states} == {("X", None)}
    assert not bus.worker.claims


async def test_claims_end_with_their_batches_under_backend_terminations(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str
) -> None:
    # One backend of the worker at random ended for real (pg_terminate_backend)
    # every 50 ms during a drain of 2,000 messages by two loops: claims end with
    # their batches (those claimed ahead by a finish included), so nothing stays
    # in flight, renewed for nobody, and every message is handled.
    bus = make_bus("billing", concurrency=2, poll_interval=0.1, reconnect_max_delay=0.1)
    seen: set[int] = set()

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        seen.add(msg.n)
        await asyncio.sleep(0.001)

    await _backlog(make_bus, db, 2000)
    killer = await asyncpg.connect(dsn)
    spared = [killer.get_server_pid(), db.get_server_pid()]
    ended = 0

    async def terminate() -> None:
        nonlocal ended
        while True:
            await asyncio.sleep(0.05)
            ended += await killer.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM (SELECT pid FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> ALL($1::int[])"
                " AND backend_type = 'client backend' ORDER BY random() LIMIT 1) AS one",
                spared,
            )

    try:
        async with bus:
            task = asyncio.create_task(terminate())
            try:
                await wait_until(lambda: len(seen), until=lambda n: n == 2000, timeout=90)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await wait_until(lambda: _ready(db), until=lambda n: n == 0, timeout=20)
            # Every claim has ended: nothing of the drain is kept in flight.
            await wait_until(lambda: len(bus.worker.in_flight), until=lambda n: n == 0, timeout=5)
    finally:
        await killer.close()
    assert ended >= 20, ended
    assert seen == set(range(2000))
    states = Counter(r["subqueue"] for r in await db.fetch("SELECT subqueue FROM nmbus.billing"))
    assert states == {"X": 2000}


async def test_a_claim_taken_ahead_ends_when_its_loop_loses_the_connection_first(
    make_bus: Callable[..., Bus],
    db: asyncpg.Connection,
    dsn: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A finish claims the next batch; the loop's backend is then ended for real
    # before that batch begins, with nothing in between to notice. The batch fails
    # at once and runs again as the loop's first batch once it has connected again
    # (nmbus/consume/worker.py, _run_again): nothing is kept in flight, renewed for
    # nobody, and the drain completes. (Held batches,
    # removed, stranded such a batch for the life of the process.)
    bus = make_bus(
        "billing", batch_size=5, batch_commit_interval=0.02, lease_seconds=2.0, poll_interval=5.0
    )
    seen: list[int] = []
    killer = await asyncpg.connect(dsn)
    ended: list[int] = []
    real = PostgresBatch.finish_and_claim

    async def ended_after(self: PostgresBatch, *args: Any) -> Any:
        changed, rows = await real(self, *args)
        if rows and not ended:
            pid = self.connection.get_server_pid()
            ended.append(pid)
            await killer.execute("SELECT pg_terminate_backend($1)", pid)
            await wait_until(self.connection.is_closed, timeout=10, what="the connection closed")
        return changed, rows

    monkeypatch.setattr(PostgresBatch, "finish_and_claim", ended_after)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)
        await asyncio.sleep(0.03)  # a batch commits in parts

    await _backlog(make_bus, db, 20)
    try:
        async with bus:
            await wait_until(lambda: len(set(seen)), until=lambda n: n == 20, timeout=30)
            await wait_until(lambda: _ready(db), until=lambda n: n == 0, timeout=20)
            await wait_until(lambda: len(bus.worker.in_flight), until=lambda n: n == 0, timeout=5)
    finally:
        await killer.close()
    assert ended
    assert sorted(set(seen)) == list(range(20))
    rows = await db.fetch("SELECT subqueue, retry_count FROM nmbus.billing")
    # The batch claimed ahead started its first message (it needs no connection)
    # before its part commit met the closed connection: the server cut the batch
    # short, so it ran again under its claim in the loop's next session, that
    # attempt not counted (it once was); the rest of it spent none either.
    states = Counter((r["subqueue"], r["retry_count"]) for r in rows)
    assert states == {("X", 1): 20}


async def test_a_loop_cancelled_by_its_handler_frees_its_claim(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # A handler cancels its own task (the loop's), as a misused library might: the
    # loop ends, though the worker is not stopping. Its claim is freed at once, the
    # cancelled message with its attempt counted, its unstarted batch-mates without:
    # the other loop runs them all within a moment, not a lease (60 s) later, and no
    # row stays leased, renewed for nobody, for the life of the process.
    bus = make_bus("billing", concurrency=2, batch_size=5, lease_seconds=60.0, poll_interval=0.2)
    seen: list[tuple[int, int]] = []

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        seen.append((msg.n, ctx.retry_count))
        if msg.n == 0 and ctx.retry_count == 1:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            await asyncio.sleep(1)

    await _backlog(make_bus, db, 5)
    async with bus:
        await wait_until(lambda: _ready(db), until=lambda n: n == 0, timeout=15)
        assert not bus.worker.claims and not bus.worker.in_flight
    rows = await db.fetch("SELECT msg_text, subqueue, retry_count FROM nmbus.billing ORDER BY id")
    assert [(r["subqueue"], r["retry_count"]) for r in rows] == [("X", 2)] + [("X", 1)] * 4
    assert sorted(n for n, _ in seen) == [0, 0, 1, 2, 3, 4]
