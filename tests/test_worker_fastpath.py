"""The worker's fast paths keep the semantics of the slow ones.

A handler that never waits runs without a timer; one that waits runs under its
timeout. A batch that writes nothing commits its finish by itself and claims
the next batch in the same statement; losing a lease there is logged, not
retried.
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
import structlog

from nmbus import Bus, Context, DatabaseUnavailable
from nmbus.errors import StoreError
from nmbus.postgres.session import PostgresBatch, PostgresSession
from nmbus.postgres.store import PostgresStore
from nmbus.testing import drain
from tests.messages import Ping
from tests.waits import wait_until


async def test_waiting_and_non_waiting_handlers_succeed_fail_and_time_out(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", max_attempts=1)
    seen: list[int] = []

    @bus.handler(timeout=0.3)
    async def handle(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)
        if msg.n == 1:
            raise ValueError("raised before any await")
        if msg.n >= 2:
            await asyncio.sleep(0)  # the handler now waits at least once
        if msg.n == 3:
            raise KeyError("raised after an await")
        if msg.n == 4:
            await asyncio.sleep(30)  # past its timeout

    async with bus:
        for n in range(5):
            await bus.send(Ping(n=n), to="billing")
        await drain(bus, timeout=30)
    rows = await db.fetch('SELECT msg_text, subqueue, error_info FROM nmbus."billing" ORDER BY id')
    by_n = {int(r["msg_text"].split(":")[1].rstrip("}")): r for r in rows}
    assert sorted(seen) == [0, 1, 2, 3, 4]
    assert [by_n[n]["subqueue"] for n in range(5)] == ["X", "F", "X", "F", "F"]
    assert by_n[1]["error_info"].startswith("ValueError: raised before any await")
    assert by_n[3]["error_info"].startswith("KeyError: 'raised after an await'")
    assert by_n[4]["error_info"].startswith("HandlerTimeout")


async def test_batches_follow_one_another_and_each_message_runs_once(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", batch_size=7)
    seen: list[int] = []

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)
        if msg.n % 10 == 0:  # some batches write, most do not
            await ctx.connection.execute("SELECT 1")

    async with Bus("sender", dsn=bus.settings.dsn, concurrency=0) as sender:
        for n in range(50):
            await sender.send(Ping(n=n), to="billing")
    async with bus:
        await drain(bus, timeout=30)
    assert sorted(seen) == list(range(50))
    counts = await db.fetch(
        "SELECT subqueue, retry_count, handling_client_id IS NULL AS free, count(*) "
        'FROM nmbus."billing" GROUP BY 1, 2, 3'
    )
    assert [tuple(r) for r in counts] == [("X", 1, True, 50)]


async def test_a_lease_lost_in_a_batch_that_wrote_nothing_is_logged_not_rerun(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str
) -> None:
    bus = make_bus("billing", batch_size=10)
    seen: list[int] = []
    thief = await asyncpg.connect(dsn)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)
        if msg.n == 2:
            # Another worker takes this row over, as if our lease had run out.
            await thief.execute(
                'UPDATE nmbus."billing" SET handling_client_id = $2 WHERE id = $1',
                ctx.message_id,
                "thief",
            )

    try:
        async with Bus("sender", dsn=dsn, concurrency=0) as sender:
            for n in range(5):
                await sender.send(Ping(n=n), to="billing")
        with structlog.testing.capture_logs() as logs:
            async with bus:
                await wait_until(
                    lambda: (len(seen), len(bus.worker.in_flight)),
                    until=lambda state: state[0] >= 5 and state[1] == 0,
                    what="(messages seen, in flight) to be (5, 0)",
                )
                await asyncio.sleep(0.2)
    finally:
        await thief.close()
    assert sorted(seen) == [0, 1, 2, 3, 4]  # nobody ran twice
    lost = [e for e in logs if e["event"] == "lease_lost"]
    assert len(lost) == 1 and lost[0]["messages"] == 1
    rows = await db.fetch('SELECT subqueue, handling_client_id FROM nmbus."billing" ORDER BY id')
    assert [tuple(r) for r in rows] == [
        ("X", None),
        ("X", None),
        ("I", "thief"),
        ("X", None),
        ("X", None),
    ]


async def test_savepoints_released_late_still_undo_only_the_failing_handler(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    await db.execute("CREATE TABLE effects (n int PRIMARY KEY)")
    bus = make_bus("billing", batch_size=20, max_attempts=1)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        await ctx.connection.execute("INSERT INTO effects (n) VALUES ($1)", msg.n)
        if msg.n % 4 == 1:
            raise ValueError("fails after its write")
        if msg.n % 4 == 2:
            # A statement fails and the handler swallows it: this handler fails,
            # not the next one and not the batch.
            with contextlib.suppress(asyncpg.UniqueViolationError):
                await ctx.connection.execute("INSERT INTO effects (n) VALUES ($1)", msg.n)

    async with Bus("sender", dsn=bus.settings.dsn, concurrency=0) as sender:
        for n in range(12):
            await sender.send(Ping(n=n), to="billing")
    async with bus:
        await drain(bus, timeout=30)
    effects = [r["n"] for r in await db.fetch("SELECT n FROM effects ORDER BY n")]
    assert effects == [n for n in range(12) if n % 4 in (0, 3)]
    states = await db.fetch('SELECT subqueue, error_info FROM nmbus."billing" ORDER BY id')
    assert [r["subqueue"] for r in states] == ["X", "F", "F", "X"] * 3
    assert "InFailedSQLTransaction" in states[2]["error_info"]


async def _ended_first(
    bus: Bus, killer: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch, step: str
) -> list[int]:
    """Patch the session's ``step`` to end its connection for real first
    (pg_terminate_backend), once, when a batch claimed by a finish waits to run;
    returns the list the ended backend's pid is put in."""
    killed: list[int] = []
    real = getattr(PostgresSession, step)

    async def ended_first(self: PostgresSession, *args: Any) -> Any:
        if not killed and bus.worker.in_flight:
            pid = self._conn.get_server_pid()
            killed.append(pid)
            await killer.execute("SELECT pg_terminate_backend($1)", pid)
            await wait_until(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
                pid,
                db=killer,
                until=lambda n: n == 0,
                what="the terminated backend gone",
            )
        return await real(self, *args)

    monkeypatch.setattr(PostgresSession, step, ended_first)
    return killed


async def _backlog(bus: Bus, conn: asyncpg.Connection) -> None:
    """Pings 0-19 in one transaction: one backlog, each finish claims the next batch."""
    async with conn.transaction():
        for n in range(20):
            await bus.send(Ping(n=n), to="billing", connection=conn)


async def _all_seen(seen: list[int]) -> None:
    """Wait until the handler has seen the 20 Pings (given back, they come soon)."""
    await wait_until(lambda: len(seen), until=lambda n: n >= 20, timeout=8, what="20 handled")


@pytest.mark.parametrize("pool", ["free", "held by the application"])
async def test_a_batch_claimed_by_a_finish_is_given_back_when_its_loop_loses_its_connection(
    make_bus: Callable[..., Bus],
    db: asyncpg.Connection,
    dsn: str,
    monkeypatch: pytest.MonkeyPatch,
    pool: str,
) -> None:
    # The finish of a batch claims the next one; the loop's connection is then ended
    # for real (pg_terminate_backend) before that batch begins, at the loop's periodic
    # release of sequences. The batch is given back at once, its attempt not counted:
    # kept in flight, its leases were renewed until the worker stopped. Given back
    # off the send pool, even when the application holds all of it.
    bus = make_bus(
        "billing", batch_size=5, poll_interval=0.05, reconnect_max_delay=0.2, send_pool_size=1
    )
    seen: list[int] = []
    killer = await asyncpg.connect(dsn)
    killed = await _ended_first(bus, killer, monkeypatch, "release_sequences")

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)
        await asyncio.sleep(0.02)  # a batch outlasts the poll interval

    try:
        await _backlog(bus, killer)
        async with bus:
            async with contextlib.AsyncExitStack() as application:
                if pool != "free":
                    await application.enter_async_context(bus.store.pool.acquire())  # type: ignore[attr-defined]
                await _all_seen(seen)
            await drain(bus, timeout=20)
            assert not bus.worker.in_flight
    finally:
        await killer.close()
    assert killed
    assert sorted(seen) == list(range(20))
    counts = await db.fetch(
        'SELECT subqueue, retry_count, count(*) FROM nmbus."billing" GROUP BY 1, 2'
    )
    assert [tuple(r) for r in counts] == [("X", 1, 20)]


async def test_a_batch_claimed_by_a_finish_with_a_suspect_is_given_back_when_isolating_it_fails(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As above, but the batch claimed ahead holds a row whose earlier holder died
    # (its lease ran out), and the connection ends as the suspect is being set
    # apart. The fresh rows are given back at once; the suspect keeps its lease,
    # runs out and comes back still a suspect, to be tried alone.
    bus = make_bus(
        "billing", batch_size=5, poll_interval=0.05, reconnect_max_delay=0.2, lease_seconds=1.0
    )
    seen: list[int] = []
    killer = await asyncpg.connect(dsn)
    killed = await _ended_first(bus, killer, monkeypatch, "isolate")

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)

    try:
        await _backlog(bus, killer)
        # Ping 7 (in the second batch) was claimed by a worker that died on it.
        await killer.execute(
            'UPDATE nmbus."billing" SET handling_client_id = $1, retry_count = 1, '
            "lease_expires = now() - interval '1 second' WHERE msg_text LIKE $2",
            "gone",
            '%"n":7}',
        )
        async with bus:
            await _all_seen(seen)
            await drain(bus, timeout=20)
            assert not bus.worker.in_flight
    finally:
        await killer.close()
    assert killed
    assert sorted(seen) == list(range(20))
    rows = await db.fetch('SELECT msg_text, subqueue, retry_count FROM nmbus."billing"')
    counts = {r["msg_text"]: (r["subqueue"], r["retry_count"]) for r in rows}
    suspect = counts.pop(next(t for t in counts if '"n":7}' in t))
    # Its dead holder's attempt, the claim ahead's (its lease ran out) and the last.
    assert suspect == ("X", 3)
    assert set(counts.values()) == {("X", 1)}


async def test_a_batch_claimed_again_by_another_loop_is_not_given_back_under_it(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Loop A's session hangs with a batch claimed ahead while the lease renewer
    # fails, for longer than a lease: the batch's rows come back, and loop B (the
    # same process, the same client id) claims them as a crash's and runs them.
    # When A's session fails at last, the batch it gives back is B's now: every row
    # claimed again is left to B, none runs twice.
    bus = make_bus(
        "billing",
        concurrency=2,
        batch_size=5,
        lease_seconds=1.0,
        poll_interval=0.01,  # a loop releases sequences before each batch
        reconnect_max_delay=0.2,
    )
    ahead: dict[int, bool] = {}  # by connection: whether its last finish claimed a batch
    hung: list[float] = []
    runs: Counter[int] = Counter()
    finish_and_claim, release = PostgresBatch.finish_and_claim, PostgresSession.release_sequences
    renew = PostgresStore.renew_leases

    async def noted(self: PostgresBatch, *args: Any) -> Any:
        changed, claimed = await finish_and_claim(self, *args)
        ahead[id(self._conn)] = bool(claimed)
        return changed, claimed

    async def hangs_once(self: PostgresSession, queue: str) -> int:
        if not hung and ahead.pop(id(self._conn), False):
            hung.append(time.monotonic())
            await asyncio.sleep(2.5)
            raise DatabaseUnavailable("the connection hung, then ended")
        return await release(self, queue)

    async def fails_meanwhile(self: PostgresStore, *args: Any) -> None:
        if hung and time.monotonic() - hung[0] < 1.3:
            raise StoreError("renew leases: the connection is gone")
        await renew(self, *args)

    monkeypatch.setattr(PostgresBatch, "finish_and_claim", noted)
    monkeypatch.setattr(PostgresSession, "release_sequences", hangs_once)
    monkeypatch.setattr(PostgresStore, "renew_leases", fails_meanwhile)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        runs[msg.n] += 1
        # A batch takes 0.1 s; a crash's suspect runs on past A's failure.
        await asyncio.sleep(2.0 if ctx.retry_count > 1 else 0.02)

    async with bus:
        async with db.transaction():
            for n in range(30):
                await bus.send(Ping(n=n), to="billing", connection=db)
        await wait_until(lambda: sum(runs.values()), until=lambda n: n >= 30, timeout=30)
        await wait_until(lambda: time.monotonic() - hung[0], until=lambda t: t > 4, timeout=30)
        await drain(bus, timeout=30)
    assert hung
    assert runs == Counter(range(30))  # each once
