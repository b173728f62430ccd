"""Planner statistics a burst has outgrown (nmbus/postgres/outgrown.py): a queue analyzed
at rest plans its claim as a sort of every ready row; the workers analyze the segment
when a burst arrives instead of waiting for autovacuum."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime

import asyncpg
import pytest

from nmbus import Bus, Context
from nmbus.messages import StoredMessage
from nmbus.postgres import outgrown
from nmbus.postgres.floor import NO_FLOOR, ReadyFloors
from nmbus.postgres.listen import notify_channel
from nmbus.postgres.outgrown import analyze_outgrown
from nmbus.postgres.sql import render
from nmbus.postgres.store import WORKER_SERVER_SETTINGS
from nmbus.settings import Settings
from tests.messages import Ping
from tests.segment_rows import add, make_queue
from tests.waits import wait_until

LAST_ANALYZE = (
    "SELECT greatest(last_analyze, last_autoanalyze) FROM pg_stat_user_tables "
    "WHERE relid = 'nmbus.\"billing$s0\"'::regclass"
)


async def at_rest(dsn: str, db: asyncpg.Connection) -> None:
    """A queue whose rows were all processed when it was last analyzed."""
    await make_queue(dsn)
    await add(db, 20_000, "X", prefix="done")
    await db.execute("ANALYZE nmbus.billing")


async def burst(db: asyncpg.Connection, n: int = 30_000) -> None:
    await add(db, n, "I", ago="0 seconds", prefix="burst")
    await db.execute("SELECT pg_stat_force_next_flush()")


async def look(conn: asyncpg.Connection, marked: tuple[int, ...] = (0,)) -> list[int]:
    """What a worker's look at queue billing analyzes, full claims having taken rows
    from segments ``marked``."""
    return await analyze_outgrown(conn, "nmbus", "billing", marked)


@pytest.fixture
async def outgrown_queue(dsn: str, db: asyncpg.Connection) -> None:
    """A queue at rest, then a burst of 30,000 messages."""
    await at_rest(dsn, db)
    await burst(db)


async def claim_plan(dsn: str) -> str:
    worker = await asyncpg.connect(dsn, server_settings=WORKER_SERVER_SETTINGS)
    try:
        await worker.execute(f"PREPARE claim AS {render('claim', 'nmbus', 'billing')}")
        rows = await worker.fetch(f"EXPLAIN (ANALYZE) EXECUTE claim(500, 'w', 30.0, {NO_FLOOR})")
        return "\n".join(r[0] for r in rows)
    finally:
        await worker.close()


@pytest.mark.usefixtures("outgrown_queue")
async def test_a_segment_outgrown_by_a_burst_is_analyzed_and_the_claim_reads_the_ready_index(
    dsn: str, db: asyncpg.Connection
) -> None:
    # With the statistics of the queue at rest the claim used to read and sort
    # every ready row to take 500. Since schema 12 added its filter on held
    # batches' records (not_held, a hashed subplan), EXPLAIN shows the plan at
    # rest in this setup reading the ready index in order as well; the look
    # still analyzes the outgrown segment, so no plan rests on those statistics.
    assert await look(db) == [0]
    plan = await claim_plan(dsn)
    assert "Sort Method" not in plan, plan  # the ready index, in order
    # Analyzed: the segment is not outgrown again until it changes as much again.
    await db.execute("SELECT pg_stat_force_next_flush()")
    assert await look(db) == []


async def test_a_segment_no_full_claim_marked_or_whose_statistics_count_its_rows_is_left_alone(
    dsn: str, db: asyncpg.Connection
) -> None:
    await at_rest(dsn, db)
    await burst(db)
    assert await look(db, marked=()) == []  # no full claim took rows from it
    assert await look(db) == [0]
    # Its statistics count its 30,000 ready rows now: however they are drained,
    # no analyze again until one at rest says otherwise.
    await db.execute("UPDATE nmbus.billing SET subqueue = 'X' WHERE id % 3 = 0")
    assert await look(db) == []


@pytest.mark.usefixtures("outgrown_queue")
async def test_a_segment_locked_elsewhere_is_skipped_without_waiting(
    dsn: str, db: asyncpg.Connection
) -> None:
    other = await asyncpg.connect(dsn)
    try:
        async with other.transaction():
            # An analyze (or a vacuum, or a roll's DDL) of the segment under way.
            await other.execute('LOCK TABLE nmbus."billing$s0" IN SHARE UPDATE EXCLUSIVE MODE')
            began = time.monotonic()
            assert await look(db) == []
            assert time.monotonic() - began < 2.0
        # Let go: the next look analyzes it.
        assert await look(db) == [0]
    finally:
        await other.close()


@pytest.mark.usefixtures("outgrown_queue")
async def test_two_processes_looking_at_once_analyze_a_segment_once(dsn: str) -> None:
    conns = [await asyncpg.connect(dsn) for _ in range(2)]
    try:
        done = await asyncio.gather(*(look(c) for c in conns))
    finally:
        for conn in conns:
            await conn.close()
    # One took the segment; the other found it taken (or already analyzed).
    assert sorted(done) == [[], [0]]


async def test_a_worker_analyzes_the_segment_a_burst_outgrew_and_drains_it(
    dsn: str, db: asyncpg.Connection
) -> None:
    await at_rest(dsn, db)
    # Autovacuum left out: only the worker can analyze the segment here.
    await db.execute('ALTER TABLE nmbus."billing$s0" SET (autovacuum_enabled = false)')
    before = await db.fetchval(LAST_ANALYZE)
    bus = Bus("billing", settings=Settings(dsn=dsn, subscription_ttl=None))
    seen: list[int] = []

    @bus.handler
    async def count(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)

    async with bus:
        await asyncio.sleep(0.5)  # the loops have planned their claim on the queue at rest
        await burst(db)
        await db.execute("SELECT pg_notify($1, 'billing')", notify_channel("nmbus"))
        await wait_until(LAST_ANALYZE, db=db, until=lambda at: at is not None and at > before)
        await wait_until(lambda: len(seen) >= 30_000, timeout=120)
    assert len(seen) == 30_000


@pytest.mark.usefixtures("outgrown_queue")
async def test_a_segment_this_role_does_not_own_is_left_to_autovacuum(
    dsn: str, db: asyncpg.Connection
) -> None:
    role = f"nmbus_reader_{uuid.uuid4().hex[:8]}"
    await db.execute(f"CREATE ROLE {role} LOGIN")
    try:
        await db.execute(f"GRANT USAGE ON SCHEMA nmbus TO {role}")
        # It may read the segment (and so its statistics), not analyze it.
        await db.execute(f'GRANT SELECT ON nmbus.billing, nmbus."billing$s0" TO {role}')
        reader = await asyncpg.connect(dsn, user=role)
        try:
            assert await look(reader) == []
        finally:
            await reader.close()
        assert await look(db) == [0]  # the owner's worker does
    finally:
        await db.execute(f"DROP OWNED BY {role}")
        await db.execute(f"DROP ROLE {role}")


@pytest.mark.usefixtures("outgrown_queue")
async def test_a_process_analyzes_a_segment_at_most_once_a_minute(
    dsn: str, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A sample of a huge segment may miss its few ready rows: its statistics then
    # still say "none" after the analyze. Made so here for every segment.
    monkeypatch.setattr(outgrown, "THOUGHT_READY", 10**12)
    floors = ReadyFloors("nmbus", connection=lambda: pool.acquire())
    now = datetime.now(UTC)
    full = [StoredMessage(i, "a", now, 1, now, None, None, None, None, f"u{i}") for i in range(500)]
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    try:
        looks = []
        for _ in range(3):
            floors.claimed("billing", full)
            async with pool.acquire() as conn:
                await floors._renew_statistics(conn, "billing")
            looks.append(
                await db.fetchval(
                    "SELECT analyze_count FROM pg_stat_user_tables "
                    "WHERE relid = 'nmbus.\"billing$s0\"'::regclass"
                )
            )
    finally:
        await pool.close()
    assert looks[0] == looks[1] == looks[2] >= 2  # at_rest's, then one of this process
