"""The server's own limits, set by a DBA on the database (never on the server:
other tests share it): idle_in_transaction_session_timeout, statement_timeout,
a connection ended mid-batch, and a connection limit reached.

Each test sets its limit with ``ALTER DATABASE ... SET`` (or a role's ``CONNECTION
LIMIT``) on its own fresh database; connections made after it get the limit,
the test's own ``db`` (made before) does not.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
import structlog

from nmbus import Bus, Context
from nmbus.consume.worker import IDLE_MARGIN, MAX_FREE_INTERRUPTIONS
from nmbus.errors import MAX_SECONDS
from nmbus.postgres.session import MAX_TIMEOUT_MS
from nmbus.testing import drain
from tests.messages import Ping, Pong
from tests.waits import wait_until

pytestmark = pytest.mark.reliability

ROOT = Path(__file__).resolve().parents[2]


def _database(dsn: str) -> str:
    return urlsplit(dsn).path.lstrip("/")


async def _set_on_database(db: asyncpg.Connection, dsn: str, setting: str, value: str) -> None:
    await db.execute(f"ALTER DATABASE \"{_database(dsn)}\" SET {setting} = '{value}'")


async def _outcomes(db: asyncpg.Connection) -> dict[str, int]:
    rows = await db.fetch("SELECT subqueue, count(*) FROM nmbus.billing GROUP BY subqueue")
    return {r[0]: r[1] for r in rows}


def _tracebacks(logs: list[dict[str, Any]]) -> list[str]:
    return [str(e["event"]) for e in logs if "traceback" in e]


async def test_slow_handlers_that_have_written_outlive_idle_in_transaction_session_timeout(
    dsn: str, db: asyncpg.Connection
) -> None:
    # As found: 500 ms on the database, 20 handlers that write and then take 1 s;
    # the server ended each batch's connection and 17 of 20 ended in F.
    await _set_on_database(db, dsn, "idle_in_transaction_session_timeout", "500ms")
    await db.execute("CREATE TABLE effects (n int NOT NULL)")
    bus = Bus(
        "billing",
        dsn=dsn,
        concurrency=4,
        batch_size=5,
        lease_seconds=5.0,
        poll_interval=0.5,
        max_attempts=3,
        reconnect_max_delay=1.0,
    )
    runs: Counter[int] = Counter()

    @bus.handler
    async def slow(msg: Ping, ctx: Context) -> None:
        runs[msg.n] += 1
        await ctx.connection.execute("INSERT INTO effects (n) VALUES ($1)", msg.n)
        await asyncio.sleep(1.0)

    with structlog.testing.capture_logs() as logs:
        async with bus:
            for n in range(20):
                await bus.send(Ping(n=n), to="billing")
            await drain(bus, timeout=90)

    outcomes = await _outcomes(db)
    ended = sum(e["event"] == "worker_connection_lost" for e in logs)
    print(f"idle 500ms, 20 x (write, 1 s): {outcomes}, {sum(runs.values())} runs, {ended} ended")
    assert outcomes == {"X": 20}
    assert await db.fetchval("SELECT count(*) FROM effects") == 20
    assert await db.fetchval("SELECT count(DISTINCT n) FROM effects") == 20
    # Each ran once and used one attempt: the server ended no batch.
    assert runs == Counter(range(20))
    assert await db.fetchval("SELECT max(retry_count) FROM nmbus.billing") == 1
    assert "worker_connection_lost" not in {e["event"] for e in logs}


async def test_the_idle_limit_is_lifted_only_when_shorter_and_to_the_handlers_timeouts(
    dsn: str, db: asyncpg.Connection
) -> None:
    """What a batch's transaction sees: the server's setting where it is off or long
    enough, else the longest the handlers of one message may take (their timeouts)
    plus one part's commit interval and a margin, never unbounded."""

    async def seen_by_a_handler(longest: float = 7.0) -> str:
        bus = Bus("billing", dsn=dsn, concurrency=1, poll_interval=0.5, handler_timeout=3.0)
        seen: list[str] = []

        @bus.handler
        async def look(msg: Ping, ctx: Context) -> None:
            seen.append(await ctx.connection.fetchval("SHOW idle_in_transaction_session_timeout"))

        @bus.handler(timeout=longest)
        async def longer(msg: Pong, ctx: Context) -> None:
            return None

        async with bus:
            await bus.send(Ping(n=1), to="billing")
            await wait_until(lambda: seen, what="the handler's look at its transaction")
        return seen[0]

    assert await seen_by_a_handler() == "0"  # the server's default: off, nothing lifted
    await _set_on_database(db, dsn, "idle_in_transaction_session_timeout", "500ms")
    lifted = round((7.0 + 0.5 + IDLE_MARGIN) * 1000)  # Pong's 7 s, the longest
    assert await seen_by_a_handler() == f"{lifted}ms"
    await _set_on_database(db, dsn, "idle_in_transaction_session_timeout", "1h")
    assert await seen_by_a_handler() == "1h"  # never lowered
    await _set_on_database(db, dsn, "idle_in_transaction_session_timeout", "500ms")
    # A handler's timeout of 10 years: the setting's own ceiling, and batches still run.
    assert await seen_by_a_handler(MAX_SECONDS) == f"{MAX_TIMEOUT_MS}ms"


async def test_a_backend_ended_mid_batch_costs_its_messages_no_attempt(
    dsn: str, db: asyncpg.Connection
) -> None:
    """``pg_terminate_backend`` of the worker's backend while a handler of the batch
    has written: the batch's started messages run again at once, their attempt
    count as if it never happened, every effect once."""
    await db.execute("CREATE TABLE effects (n int NOT NULL)")
    bus = Bus(
        "billing",
        dsn=dsn,
        concurrency=1,
        batch_size=10,
        lease_seconds=2.0,
        poll_interval=0.5,
        max_attempts=2,
        reconnect_max_delay=0.5,
    )
    victims = {3, 17}
    runs: Counter[int] = Counter()
    written: asyncio.Queue[int] = asyncio.Queue()
    ended = asyncio.Event()

    @bus.handler
    async def write(msg: Ping, ctx: Context) -> None:
        runs[msg.n] += 1
        await ctx.connection.execute("INSERT INTO effects (n) VALUES ($1)", msg.n)
        if msg.n in victims and runs[msg.n] == 1:
            await written.put(await ctx.connection.fetchval("SELECT pg_backend_pid()"))
            await ended.wait()
            ended.clear()

    with structlog.testing.capture_logs() as logs:
        async with bus:
            for n in range(30):
                await bus.send(Ping(n=n), to="billing")
            for _ in victims:
                pid = await asyncio.wait_for(written.get(), 30)
                assert await db.fetchval("SELECT pg_terminate_backend($1)", pid)
                await wait_until(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
                    pid,
                    db=db,
                    until=lambda n: n == 0,
                    what="the backend gone",
                )
                ended.set()
            await drain(bus, timeout=60)

    attempts = await db.fetchval("SELECT max(retry_count) FROM nmbus.billing")
    print(f"2 backends ended mid-batch: {sum(runs.values())} runs of 30, max attempts {attempts}")
    assert await _outcomes(db) == {"X": 30}
    assert sorted(r[0] for r in await db.fetch("SELECT n FROM effects")) == list(range(30))
    # The victims (and any batch-mate started before them) ran twice: the end came
    # mid-batch, for real. Still one attempt each.
    assert all(runs[v] == 2 for v in victims), runs
    assert await db.fetchval("SELECT max(retry_count) FROM nmbus.billing") == 1
    assert not await db.fetchval("SELECT count(*) FROM nmbus.billing WHERE isolated")
    lost = [e for e in logs if e["event"] == "worker_connection_lost"]
    assert len(lost) == len(victims), lost
    assert _tracebacks(logs) == []


async def test_a_handler_that_ends_its_own_backend_every_time_still_reaches_f(
    dsn: str, db: asyncpg.Connection
) -> None:
    """The first MAX_FREE_INTERRUPTIONS ends are free, as conflicts are; after them
    each costs an attempt, so the message goes to F and the others are handled."""
    bus = Bus(
        "billing",
        dsn=dsn,
        concurrency=1,
        batch_size=1,
        lease_seconds=1.0,
        poll_interval=0.5,
        max_attempts=2,
        reconnect_max_delay=0.3,
    )
    runs: Counter[str] = Counter()

    @bus.handler
    async def end_own_backend(msg: Pong, ctx: Context) -> None:
        runs["pong"] += 1
        await ctx.connection.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    @bus.handler
    async def fine(msg: Ping, ctx: Context) -> None:
        runs["ping"] += 1

    async with bus:
        began = time.monotonic()
        await bus.send(Pong(n=1), to="billing")
        for n in range(5):
            await bus.send(Ping(n=n), to="billing")
        await wait_until(
            "SELECT subqueue FROM nmbus.billing WHERE label = 'test.Pong'",
            db=db,
            until=lambda sq: sq == "F",
            timeout=90,
            what="the self-ending message in F",
        )
        took = time.monotonic() - began
        await drain(bus, timeout=30)
    print(f"a handler ending its backend: F after {runs['pong']} runs, {took:.1f} s")

    info = await db.fetchval("SELECT error_info FROM nmbus.billing WHERE label = 'test.Pong'")
    assert info.startswith("AttemptsExhausted"), info
    assert runs["pong"] > MAX_FREE_INTERRUPTIONS  # the free ones were given
    assert await _outcomes(db) == {"X": 5, "F": 1}


async def test_statement_timeout_shorter_than_a_claim_a_finish_and_a_retention_step(
    dsn: str, db: asyncpg.Connection
) -> None:
    """``statement_timeout = 200ms`` on the database while an operator's lock holds
    the queue table for 1.5 s, twice: claims, finishes and retention steps are
    cancelled. One line per cancel, a growing pause, nothing lost, no effect
    twice, no attempt spent."""
    await db.execute("CREATE TABLE effects (n int NOT NULL)")
    # The queue's table made first: its DDL may take longer than 200 ms on a busy
    # machine (a start whose statement is cancelled fails, with that error).
    async with Bus("billing", dsn=dsn, concurrency=0):
        pass
    await _set_on_database(db, dsn, "statement_timeout", "200ms")
    bus = Bus(
        "billing",
        dsn=dsn,
        concurrency=2,
        batch_size=5,
        lease_seconds=10.0,
        poll_interval=0.5,
        max_attempts=2,
        reconnect_max_delay=1.0,
        retention_interval=0.2,
    )
    started = asyncio.Event()

    @bus.handler
    async def write(msg: Ping, ctx: Context) -> None:
        await ctx.connection.execute("INSERT INTO effects (n) VALUES ($1)", msg.n)
        started.set()
        await asyncio.sleep(0.1)

    locker = await asyncpg.connect(dsn, server_settings={"statement_timeout": "0"})
    try:
        with structlog.testing.capture_logs() as logs:
            async with bus:
                for n in range(200):
                    await bus.send(Ping(n=n), to="billing")
                for _ in range(2):
                    started.clear()
                    await started.wait()  # a batch under way, its finish to come
                    async with locker.transaction():
                        await locker.execute("LOCK TABLE nmbus.billing IN ACCESS EXCLUSIVE MODE")
                        await asyncio.sleep(1.5)
                await drain(bus, timeout=90)
    finally:
        await locker.close()

    outcomes = await _outcomes(db)
    print(
        f"statement_timeout 200ms, 2 locks of 1.5 s: {outcomes}, "
        f"{sum(e['event'] == 'worker_statement_cancelled' for e in logs)} cancels logged, "
        f"{sum(e['event'] == 'retention_failed' for e in logs)} retention steps cancelled, "
        f"max attempts {await db.fetchval('SELECT max(retry_count) FROM nmbus.billing')}"
    )
    assert outcomes == {"X": 200}
    assert sorted(r[0] for r in await db.fetch("SELECT n FROM effects")) == list(range(200))
    assert await db.fetchval("SELECT max(retry_count) FROM nmbus.billing") == 1
    events = Counter(str(e["event"]) for e in logs)
    cancelled = [e for e in logs if e["event"] == "worker_statement_cancelled"]
    assert cancelled, events
    assert all("statement_timeout" in str(e["error"]) for e in cancelled)
    # Each loop's pauses grew while the lock held (one line per try, no busy loop).
    for loop in (0, 1):
        pauses = [e["retry_in"] for e in cancelled if e["loop"] == loop]
        assert pauses == sorted(pauses) or len(pauses) <= 1, pauses
    assert events["retention_failed"] >= 1, events
    assert events["worker_error"] == 0 and events["batch_failed"] == 0, events
    assert _tracebacks(logs) == []


def _as_role(dsn: str, role: str) -> str:
    parts = urlsplit(dsn)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, f"{role}@{host}", parts.path, parts.query, parts.fragment))


async def _fill(dsn: str) -> list[asyncpg.Connection]:
    """Connections of ``dsn``'s role until the server refuses one for its limit."""
    held: list[asyncpg.Connection] = []
    while True:
        try:
            held.append(await asyncpg.connect(dsn))
        except asyncpg.TooManyConnectionsError:
            return held


async def test_a_worker_waits_for_a_free_connection_one_line_per_try(
    dsn: str, db: asyncpg.Connection
) -> None:
    """A role's ``CONNECTION LIMIT`` reached when the worker starts, and again when
    one of its loops must connect anew: one line per try, no traceback, a growing
    pause, and the worker goes on once connections are free."""
    role = f"nmbus_limited_{uuid.uuid4().hex[:8]}"
    name = _database(dsn)
    await db.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 8")
    try:
        # The role owns the database and installs its own schema (superusers are
        # not held to connection limits, so the worker runs as this role).
        await db.execute(f'ALTER DATABASE "{name}" OWNER TO {role}')
        await db.execute("DROP SCHEMA nmbus CASCADE")
        limited = _as_role(dsn, role)
        bus = Bus(
            "billing",
            dsn=limited,
            concurrency=1,
            poll_interval=0.5,
            reconnect_max_delay=0.8,
            send_pool_size=1,
        )
        pids: dict[int, int] = {}

        @bus.handler
        async def note(msg: Ping, ctx: Context) -> None:
            pids[msg.n] = await ctx.connection.fetchval("SELECT pg_backend_pid()")

        with structlog.testing.capture_logs() as logs:
            held = await _fill(limited)
            starting = asyncio.create_task(bus.start())
            try:
                await wait_until(
                    lambda: sum(e["event"] == "too_many_connections" for e in logs),
                    until=lambda n: n >= 4,
                    what="the start's tries",
                )
                assert not starting.done()
            finally:
                for conn in held:
                    await conn.close()
            freed = time.monotonic()
            await asyncio.wait_for(starting, 30)
            start_took = time.monotonic() - freed
            try:
                await bus.send(Ping(n=1), to="billing")
                await wait_until(
                    "SELECT count(*) FROM nmbus.billing WHERE subqueue = 'X'",
                    db=db,
                    what="the first message handled",
                )
                # The loop's connection ended while the role is full (its limit
                # lowered below what it holds: no slot its own end frees will do):
                # it cannot connect again until the limit is raised.
                await db.execute(f"ALTER ROLE {role} CONNECTION LIMIT 1")
                try:
                    await db.execute("SELECT pg_terminate_backend($1)", pids[1])
                    await wait_until(
                        lambda: sum(e["event"] == "worker_connection_lost" for e in logs),
                        until=lambda n: n >= 4,
                        what="the loop's tries",
                    )
                finally:
                    await db.execute(f"ALTER ROLE {role} CONNECTION LIMIT 8")
                freed = time.monotonic()
                for n in range(2, 6):
                    await bus.send(Ping(n=n), to="billing")
                await wait_until(
                    "SELECT count(*) FROM nmbus.billing WHERE subqueue = 'X'",
                    db=db,
                    until=lambda n: n == 5,
                    what="the messages after it",
                )
                back_took = time.monotonic() - freed
            finally:
                await bus.stop()
    finally:
        await db.execute(f'ALTER DATABASE "{name}" OWNER TO postgres')
        await db.execute(f"DROP OWNED BY {role}")
        await db.execute(f"DROP ROLE {role}")

    tries = [e for e in logs if e["event"] == "too_many_connections"]
    # One line per try, numbered, each saying why and when the next comes.
    assert [e["attempt"] for e in tries] == list(range(1, len(tries) + 1))
    assert all("too many connections for role" in str(e["error"]) for e in tries)
    pauses = [e["retry_in"] for e in tries]
    assert pauses[0] < pauses[-1] <= 0.8
    lost = [e for e in logs if e["event"] == "worker_connection_lost"]
    print(
        f"role full: the start tried {len(tries)} times, started {start_took:.2f} s after "
        f"the connections were free; the loop tried {len(lost) - 1} times, handled again "
        f"{back_took:.2f} s after; pauses up to {max(pauses)} s"
    )
    assert all("too many connections for role" in str(e["error"]) for e in lost[1:]), lost
    assert [e["event"] for e in logs].count("worker_reconnected") == 1
    assert _tracebacks(logs) == []
    assert "worker_error" not in {e["event"] for e in logs}


def _worker_process(dsn: str) -> subprocess.Popen[str]:
    """``nmbus worker tests.cli_app:bus`` on ``dsn``, its log lines on stderr."""
    return subprocess.Popen(
        [sys.executable, "-m", "nmbus", "worker", "tests.cli_app:bus"],
        cwd=ROOT,
        env={**os.environ, "NMBUS_DSN": dsn, "NMBUS_RECONNECT_MAX_DELAY": "0.5"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


async def test_a_worker_process_waiting_for_a_connection_stops_at_sigterm(
    dsn: str, db: asyncpg.Connection
) -> None:
    """``nmbus worker`` whose role may open no connection: it waits, one line per
    try, and a SIGTERM meanwhile ends it at once, exit 0, no traceback."""
    role = f"nmbus_none_{uuid.uuid4().hex[:8]}"
    await db.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 0")
    lines: list[str] = []
    try:
        with _worker_process(_as_role(dsn, role)) as proc:  # closes its pipe at the end
            try:
                assert proc.stderr is not None
                while sum("too_many_connections" in line for line in lines) < 3:
                    line = await asyncio.wait_for(asyncio.to_thread(proc.stderr.readline), 30)
                    assert line, f"the worker exited: {lines}"
                    lines.append(line)
                proc.send_signal(signal.SIGTERM)
                code = await asyncio.to_thread(proc.wait, 30)
                lines.extend(proc.stderr.read().splitlines())
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    finally:
        await db.execute(f"DROP ROLE {role}")
    assert code == 0, lines
    assert not any("Traceback" in line for line in lines), lines
    tries = [line for line in lines if "too_many_connections" in line]
    assert all("too many connections for role" in line for line in tries), tries


async def test_a_send_pool_that_cannot_reconnect_says_so_in_one_line_per_retry(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The send pool keeps one connection open; when the server ends it and takes no
    # new one (a failover under way, the database closed to connections), asyncpg's
    # pool retries in the background and logged each retry with a traceback.
    from tests.pg import with_database

    admin = await asyncpg.connect(with_database(dsn, "postgres"))
    name = _database(dsn)
    bus = Bus("billing", dsn=dsn, concurrency=0)
    try:
        async with bus:
            await bus.send(Ping(n=1), to="billing")
            await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1", name
            )
            with caplog.at_level("WARNING", logger="asyncpg.pool"):
                await wait_until(
                    lambda: len([r for r in caplog.records if r.name == "asyncpg.pool"]),
                    until=lambda n: n >= 2,
                    timeout=20,
                    what="two retries of the pool's floor",
                )
            await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
    finally:
        await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        await admin.close()
    retries = [r for r in caplog.records if r.name == "asyncpg.pool"]
    for record in retries:
        assert record.exc_info is None and record.exc_text is None
        text = record.getMessage()
        assert "\n" not in text and "not currently accepting connections" in text, text
