"""Segments (DESIGN.md section 10, docs/storage.md): a queue's rows in partitions by
ranges of id, rolled ahead and dropped whole by retention."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import asyncpg
import pyarrow.dataset as ds
import pytest

from nmbus import Bus, Context
from nmbus.errors import InvalidSetting
from nmbus.ports.operations import RetentionPolicy
from nmbus.postgres import install_schema
from nmbus.postgres.floor import NO_FLOOR, read_floor
from nmbus.postgres.retention import clean_queue
from nmbus.postgres.segments import advance, current_segment, lock_key, roll, segments
from nmbus.postgres.sql import SEGMENT_SPAN, render
from nmbus.postgres.store import WORKER_SERVER_SETTINGS
from nmbus.settings import Settings
from tests.legacy import make_v9
from tests.messages import Ping
from tests.procs import Proc
from tests.segment_rows import add, make_queue
from tests.waits import wait_until

SEGMENTS_OF = (
    "SELECT array_agg(relid::regclass::text ORDER BY relid::regclass::text) "
    "FROM pg_partition_tree('nmbus.billing') WHERE isleaf"
)
KIND = "SELECT relkind FROM pg_class WHERE oid = 'nmbus.billing'::regclass"
PLAIN = "INSERT INTO nmbus.billing (from_endpoint, to_endpoint, unique_id) VALUES ('a', 'b', $1)"
DAY = RetentionPolicy(max_age=timedelta(days=1))


async def numbers(db: asyncpg.Connection) -> list[int]:
    return [int(s.number) for s in await segments(db, "nmbus", "billing")]


# -- the layout and the roll -------------------------------------------------------------


async def killed_session_gone(db: asyncpg.Connection) -> None:
    """Wait until the server has seen a killed client go: its advisory locks are free."""
    await wait_until(
        lambda: db.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND "
            "database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ),
        until=lambda n: n == 0,
    )


@contextlib.asynccontextmanager
async def holding(dsn: str, statement: str, *args: object) -> AsyncIterator[None]:
    """Another session's open transaction, which has run ``statement`` (and holds its locks)."""
    other = await asyncpg.connect(dsn)
    try:
        async with other.transaction():
            await other.execute(statement, *args)
            yield
    finally:
        await other.close()


async def test_a_queue_is_segments_and_rolls_ahead(dsn: str, db: asyncpg.Connection) -> None:
    await make_queue(dsn)
    assert await db.fetchval(KIND) == b"p"
    assert await numbers(db) == [0, 1]
    assert await roll(db, "nmbus", "billing", 1.0) is None  # empty: nothing to roll
    await add(db, 3, "I", ago="0 seconds")
    assert await roll(db, "nmbus", "billing", 2.0) is None  # not 2 seconds old yet
    await asyncio.sleep(2.1)
    assert await roll(db, "nmbus", "billing", 2.0) == 1  # a 2-second width works
    assert await numbers(db) == [0, 1, 2]  # one more made ahead
    await add(db, 1, "I", ago="0 seconds", prefix="later")
    new = await db.fetchval("SELECT max(id) FROM nmbus.billing")
    assert new >= SEGMENT_SPAN and await current_segment(db, "nmbus", "billing") == 1
    # Rows never move: the earlier rows are where they were, every one claimable.
    assert await db.fetchval('SELECT count(*) FROM nmbus."billing$s0"') == 3
    floor = await read_floor(db, "nmbus", "billing")
    assert len(await db.fetch(render("claim", "nmbus", "billing"), 10, "w", 30.0, floor)) == 4


async def test_a_new_segment_does_not_wait_for_open_transactions(
    dsn: str, db: asyncpg.Connection
) -> None:
    await make_queue(dsn)
    await add(db, 1, "I")
    # Holds the queue table as every writer does.
    async with holding(
        dsn, "INSERT INTO nmbus.billing (from_endpoint, to_endpoint) VALUES ('a', 'b')"
    ):
        started = time.perf_counter()
        assert await advance(db, "nmbus", "billing") == 1
        assert time.perf_counter() - started < 1.0
    assert await numbers(db) == [0, 1, 2]


@pytest.mark.parametrize(
    "held",
    [
        # A drop (or an operator) holds the whole table.
        ("LOCK TABLE nmbus.billing IN ACCESS EXCLUSIVE MODE",),
        # A roll or a drop of this queue, stuck while it holds the queue's advisory lock.
        (render("advisory_lock", "nmbus"), lock_key("nmbus", "billing")),
    ],
    ids=["queue-table", "advisory-lock"],
)
async def test_a_roll_behind_a_held_lock_gives_up_at_once_and_rolls_next_time(
    dsn: str, db: asyncpg.Connection, held: tuple[str, ...]
) -> None:
    await make_queue(dsn)
    await add(db, 1, "I")
    async with holding(dsn, *held):
        started = time.perf_counter()
        assert await advance(db, "nmbus", "billing") is None
        assert time.perf_counter() - started < 2.0  # LOCK_TIMEOUT, not the holder's time
        assert await db.fetchval("SHOW lock_timeout") == "0"  # only the roll's transaction
    assert await numbers(db) == [0, 1]
    assert await advance(db, "nmbus", "billing") == 1
    assert await numbers(db) == [0, 1, 2]


async def test_a_roll_whose_segment_ahead_must_wait_still_says_it_rolled(
    dsn: str, db: asyncpg.Connection
) -> None:
    await make_queue(dsn)
    await add(db, 1, "I")
    # Blocks the attach of a segment, not the note on one nor the move.
    async with holding(dsn, "LOCK TABLE ONLY nmbus.billing IN SHARE UPDATE EXCLUSIVE MODE"):
        assert await advance(db, "nmbus", "billing") == 1
    assert await current_segment(db, "nmbus", "billing") == 1
    assert await numbers(db) == [0, 1]  # the segment ahead was left to the next run
    await add(db, 1, "I", prefix="after")
    assert await db.fetchval('SELECT count(*) FROM nmbus."billing$s1"') == 1
    assert await advance(db, "nmbus", "billing") == 2  # it makes 2 first, then moves
    assert await numbers(db) == [0, 1, 2, 3]


def test_segment_seconds_is_checked() -> None:
    assert Settings(segment_seconds=2).segment_seconds == 2.0
    for bad in (0, 0.5, float("inf"), float("nan"), 40 * 86400):
        with pytest.raises((InvalidSetting, ValueError)):
            Settings(segment_seconds=bad)
    with pytest.raises(ValueError, match="segment_seconds"):
        RetentionPolicy(segment_seconds=0.1)


# -- unique_id across segments -----------------------------------------------------------


async def test_a_unique_id_stays_unique_across_segments_until_its_segment_goes(
    dsn: str, db: asyncpg.Connection
) -> None:
    async with Bus("shop", dsn=dsn, concurrency=0) as bus:
        await make_queue(dsn)
        await bus.send(Ping(n=1), to="billing", unique_id="k")
        assert await advance(db, "nmbus", "billing") == 1
        await bus.send(Ping(n=2), to="billing", unique_id="k")  # in segment 1: skipped
        assert await db.execute(PLAIN, "k") == "INSERT 0 0"
        assert await db.fetchval("SELECT count(*) FROM nmbus.billing WHERE unique_id = 'k'") == 1

        # Two inserts of one unique_id at once, on either side of a roll: one is stored.
        first = await asyncpg.connect(dsn)
        second = await asyncpg.connect(dsn)
        try:
            tx = first.transaction()
            await tx.start()
            await first.execute(PLAIN, "race")  # segment 1, not committed
            assert await advance(db, "nmbus", "billing") == 2
            later = asyncio.create_task(second.execute(PLAIN, "race"))
            await asyncio.sleep(0.3)
            assert not later.done()  # it waits on the unique table's entry
            await tx.commit()
            assert await later == "INSERT 0 0"
        finally:
            await first.close()
            await second.close()
        assert await db.fetchval("SELECT count(*) FROM nmbus.billing WHERE unique_id = 'race'") == 1

        # Once the row's segment is dropped, its unique_id may be used again.
        await db.execute(
            "UPDATE nmbus.billing SET subqueue = 'X', last_processed = now() - interval '2 days' "
            "WHERE unique_id = 'k'"
        )
        result = await clean_queue(
            db, "nmbus", "billing", RetentionPolicy(max_age=timedelta(days=1))
        )
        assert result.deleted["X"] == 1 and result.segments_dropped >= 1
        assert (
            await db.fetchval(
                'SELECT count(*) FROM nmbus."billing$unique" WHERE unique_id = $1', "k"
            )
            == 0
        )
        await bus.send(Ping(n=3), to="billing", unique_id="k")
        assert await db.fetchval("SELECT count(*) FROM nmbus.billing WHERE unique_id = 'k'") == 1


# -- retention by segments ---------------------------------------------------------------


async def queue_bytes(db: asyncpg.Connection) -> int:
    return int(
        await db.fetchval(
            "SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree('nmbus.billing')"
        )
    )


async def test_retention_gives_the_space_back_without_vacuum(
    dsn: str, db: asyncpg.Connection
) -> None:
    await make_queue(dsn)
    await add(db, 20_000, "X")
    assert await advance(db, "nmbus", "billing") == 1
    await add(db, 50, "I", ago="0 seconds", prefix="new")
    before = await queue_bytes(db)
    result = await clean_queue(db, "nmbus", "billing", DAY)
    assert result.deleted == {"X": 20_000, "F": 0} and result.segments_dropped == 1
    after = await queue_bytes(db)
    # The removed rows were 20,000 of 20,050: their share of the files is gone, no VACUUM.
    assert after < before * 0.1, (before, after)
    assert await numbers(db) == [1, 2]
    dead = await db.fetchval(
        "SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables "
        "WHERE relid IN (SELECT relid FROM pg_partition_tree('nmbus.billing'))"
    )
    assert dead == 0
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing WHERE subqueue = 'I'") == 50


SEGMENT_0 = 'nmbus."billing$s0"'


async def size_of(db: asyncpg.Connection, segment: str) -> int:
    return int(await db.fetchval("SELECT pg_total_relation_size($1::text::regclass)", segment))


@pytest.mark.parametrize("archive", [False, True], ids=["drop", "archive"])
async def test_one_run_removes_the_old_rows_of_the_segment_being_written(
    dsn: str, db: asyncpg.Connection, tmp_path: Path, archive: bool
) -> None:
    """A queue no run has rolled yet keeps every row in segment 0, the one being written:
    one run rolls it first, so the same run drops it."""
    await make_queue(dsn)
    await add(db, 5_000, "X")
    assert await current_segment(db, "nmbus", "billing") == 0
    expected = [r[0] for r in await db.fetch("SELECT id FROM nmbus.billing ORDER BY id")]
    size = await size_of(db, SEGMENT_0)
    policy = RetentionPolicy(max_age=timedelta(days=1), archive_dir=tmp_path if archive else None)
    result = await clean_queue(db, "nmbus", "billing", policy)
    assert result.deleted == {"X": 5_000, "F": 0} and result.segments_dropped == 1
    assert result.bytes_freed == size > 0
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing") == 0
    assert await numbers(db) == [1, 2]  # 0 dropped, 1 now written, 2 made ahead
    assert await current_segment(db, "nmbus", "billing") == 1
    if archive:
        archived = ds.dataset(tmp_path, format="parquet", partitioning="hive").to_table()
        assert sorted(archived.column("id").to_pylist()) == expected
        assert not await asyncio.to_thread(lambda: list(tmp_path.rglob(".pending-*")))
    # Nothing left past the age: the next run neither rolls nor drops.
    again = await clean_queue(db, "nmbus", "billing", policy)
    assert (again.total, again.segments_dropped, again.bytes_freed) == (0, 0, 0)
    assert await numbers(db) == [1, 2]


async def test_live_rows_of_the_segment_being_written_move_on_and_its_old_rows_go(
    dsn: str, db: asyncpg.Connection
) -> None:
    await make_queue(dsn)
    await add(db, 1_000, "X")
    await add(db, 3, "I", ago="0 seconds", prefix="live")
    await add(db, 1, "F", ago="1 hour")  # younger than failed_max_age: it waits
    await add(db, 1, "R", ago="-3 days")  # scheduled three days ahead
    before = {
        r["unique_id"]: dict(r)
        for r in await db.fetch("SELECT * FROM nmbus.billing WHERE subqueue <> 'X'")
    }
    policy = RetentionPolicy(max_age=timedelta(days=1), failed_max_age=timedelta(hours=2))
    result = await clean_queue(db, "nmbus", "billing", policy)
    assert result.deleted == {"X": 1_000, "F": 0}
    assert (result.segments_dropped, result.rows_moved, result.segments_pinned) == (1, 5, 0)
    assert await numbers(db) == [1, 2]
    # Every waiting row is in the segment now written, with a new id and nothing else changed.
    after = {r["unique_id"]: dict(r) for r in await db.fetch("SELECT * FROM nmbus.billing")}
    assert set(after) == set(before)
    for key, row in after.items():
        assert SEGMENT_SPAN <= row["id"] < 2 * SEGMENT_SPAN
        assert dict(row, id=0) == dict(before[key], id=0)
    floor = await read_floor(db, "nmbus", "billing")
    assert len(await db.fetch(render("claim", "nmbus", "billing"), 10, "w", 30.0, floor)) == 3


async def test_what_keeps_an_old_segment_keeps_the_segment_being_written(
    dsn: str, db: asyncpg.Connection
) -> None:
    # Segments a week wide: the rows (two days old) never roll the segment by its time,
    # only because they are past the age.
    policy = RetentionPolicy(max_age=timedelta(days=1), segment_seconds=7 * 86400)
    await make_queue(dsn)
    # An empty queue: nothing to roll.
    assert (await clean_queue(db, "nmbus", "billing", policy)).total == 0
    assert await numbers(db) == [0, 1]
    # An X row processed within the age keeps the segment, so it is not even rolled.
    await add(db, 100, "X")
    await add(db, 1, "X", ago="1 hour", prefix="recent")
    result = await clean_queue(db, "nmbus", "billing", policy)
    assert (result.total, result.segments_dropped) == (0, 0)
    assert await numbers(db) == [0, 1] and await current_segment(db, "nmbus", "billing") == 0
    # So does a sequence member not done (its id is its place in the sequence).
    await db.execute(
        "UPDATE nmbus.billing SET last_processed = now() - interval '2 days' "
        "WHERE unique_id = 'recent-X-1'"
    )
    await add(db, 1, "I", ago="0 seconds", prefix="member")
    await db.execute(
        "UPDATE nmbus.billing SET sequence_key = 'acct-1' WHERE unique_id = 'member-I-1'"
    )
    member = await db.fetchval("SELECT id FROM nmbus.billing WHERE unique_id = 'member-I-1'")
    result = await clean_queue(db, "nmbus", "billing", policy)
    assert (result.total, result.segments_dropped) == (0, 0)
    assert await numbers(db) == [0, 1] and await current_segment(db, "nmbus", "billing") == 0
    # A row a worker holds rolls the segment, yet keeps it, with every row, until it is done.
    await db.execute(
        "UPDATE nmbus.billing SET sequence_key = NULL, handling_client_id = 'w', "
        "lease_expires = now() + interval '1 minute' WHERE id = $1",
        member,
    )
    result = await clean_queue(db, "nmbus", "billing", policy)
    assert (result.total, result.segments_dropped, result.segments_pinned) == (0, 0, 1)
    assert await current_segment(db, "nmbus", "billing") == 1
    assert await db.fetchval(f"SELECT count(*) FROM {SEGMENT_0}") == 102
    assert await db.fetchval("SELECT id FROM nmbus.billing WHERE id = $1", member) == member
    await db.execute(
        "UPDATE nmbus.billing SET subqueue = 'X', last_processed = now() - interval '2 days', "
        "handling_client_id = NULL, lease_expires = NULL WHERE id = $1",
        member,
    )
    result = await clean_queue(db, "nmbus", "billing", policy)
    assert result.deleted == {"X": 102, "F": 0} and result.segments_dropped == 1
    assert await numbers(db) == [1, 2]


async def test_two_runs_at_once_remove_the_segment_being_written_once(
    dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    await make_queue(dsn)
    await add(db, 3_000, "X")
    expected = [r[0] for r in await db.fetch("SELECT id FROM nmbus.billing ORDER BY id")]
    policy = RetentionPolicy(max_age=timedelta(days=1), archive_dir=tmp_path)
    conns = [await asyncpg.connect(dsn) for _ in range(2)]
    try:
        results = await asyncio.gather(*(clean_queue(c, "nmbus", "billing", policy) for c in conns))
    finally:
        for conn in conns:
            await conn.close()
    assert sum(r.deleted["X"] for r in results) == 3_000
    assert sum(r.segments_dropped for r in results) == 1
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing") == 0
    assert await numbers(db) == [1, 2]
    archived = ds.dataset(tmp_path, format="parquet", partitioning="hive").to_table()
    assert sorted(archived.column("id").to_pylist()) == expected  # each row once


async def test_at_the_most_segments_a_queue_keeps_one_run_still_removes_every_old_row(
    dsn: str, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the cap the segment being written cannot roll first: it rolls once the
    drops of the older segments have made room, and goes in the same run."""
    monkeypatch.setattr("nmbus.postgres.segments.MAX_LIVE_SEGMENTS", 3)
    await make_queue(dsn)
    for prefix in ("s0", "s1"):
        await add(db, 10, "X", prefix=prefix)
        assert await advance(db, "nmbus", "billing") is not None
    await add(db, 10, "X", prefix="s2")
    assert await current_segment(db, "nmbus", "billing") == 2
    result = await clean_queue(db, "nmbus", "billing", DAY)
    assert result.deleted == {"X": 30, "F": 0} and result.segments_dropped == 3
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing") == 0
    assert await numbers(db) == [3, 4]


async def test_waiting_rows_move_and_sequence_members_keep_their_segment(
    dsn: str, db: asyncpg.Connection
) -> None:
    await make_queue(dsn)
    await add(db, 100, "X")
    await add(db, 2, "F", ago="1 hour")
    await add(db, 1, "F", ago="3 hours", prefix="stale")
    await add(db, 1, "R", ago="-3 days")  # scheduled three days ahead
    before = {
        r["unique_id"]: dict(r)
        for r in await db.fetch("SELECT * FROM nmbus.billing WHERE subqueue <> 'X'")
    }
    assert await advance(db, "nmbus", "billing") == 1
    policy = RetentionPolicy(max_age=timedelta(days=1), failed_max_age=timedelta(hours=2))
    result = await clean_queue(db, "nmbus", "billing", policy)
    # The two recent F rows and the R row moved on, with a new id and nothing else
    # changed; the F row past failed_max_age went with the segment (as F).
    assert result.rows_moved == 3 and result.segments_dropped == 1
    assert result.deleted == {"X": 100, "F": 1}
    after = {r["unique_id"]: dict(r) for r in await db.fetch("SELECT * FROM nmbus.billing")}
    assert set(after) == set(before) - {"stale-F-1"}
    for key, row in after.items():
        assert row["id"] >= SEGMENT_SPAN and dict(row, id=0) == dict(before[key], id=0)
    # A moved F row is requeued like any other, with the seed's own statement.
    moved = after["r-F-1"]["id"]
    assert await db.execute(f"update nmbus.billing set subqueue='I' where id={moved}") == "UPDATE 1"

    # A sequence member not done keeps its segment (its id is its place in the sequence).
    await db.execute(
        "UPDATE nmbus.billing SET sequence_key = 'acct-1', subqueue = 'F' WHERE id = $1", moved
    )
    await add(db, 10, "X", prefix="more")
    assert await advance(db, "nmbus", "billing") == 2
    result = await clean_queue(db, "nmbus", "billing", DAY)
    assert (result.segments_dropped, result.segments_pinned, result.deleted["X"]) == (0, 1, 0)
    assert await db.fetchval("SELECT id FROM nmbus.billing WHERE sequence_key = 'acct-1'") == moved


@pytest.mark.parametrize("by_hand", [True, False], ids=["rolled-by-hand", "rolled-by-retention"])
async def test_a_worker_loses_nothing_while_retention_drops_segments(
    dsn: str, db: asyncpg.Connection, by_hand: bool
) -> None:
    handled: list[int] = []
    bus = Bus("billing", dsn=dsn, poll_interval=0.2, batch_size=20)

    @bus.handler(Ping)
    async def on_ping(msg: Ping, ctx: Context) -> None:
        handled.append(msg.n)

    total = 3000
    dropped = 0
    async with bus:
        sender = Bus("shop", dsn=dsn, concurrency=0)
        async with sender:

            async def send_all() -> None:
                for n in range(total):
                    await sender.send(Ping(n=n), to="billing")

            sending = asyncio.create_task(send_all())
            policy = RetentionPolicy(max_age=timedelta(0))
            while not sending.done() or len(handled) < total:
                if sending.done() and sending.exception() is not None:
                    raise AssertionError("the sender failed") from sending.exception()
                if by_hand:
                    await advance(db, "nmbus", "billing")
                # Otherwise the run rolls the segment being written itself, with the
                # worker claiming and finishing in it, and drops it.
                dropped += (await clean_queue(db, "nmbus", "billing", policy)).segments_dropped
                await asyncio.sleep(0.05)
            await sending
    assert sorted(handled) == list(range(total))  # each one once: none lost, none twice
    assert dropped >= 3


async def test_a_run_killed_between_archive_and_drop_archives_each_row_once(
    dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    await make_queue(dsn)
    await add(db, 500, "X")
    assert await advance(db, "nmbus", "billing") == 1
    await add(db, 300, "X", prefix="second")
    assert await advance(db, "nmbus", "billing") == 2
    expected = [r[0] for r in await db.fetch("SELECT id FROM nmbus.billing ORDER BY id")]
    for point in ("before-drop", "before-publish"):
        proc = Proc("tests.segment_kill", dsn, str(tmp_path), str(86400), point)
        try:
            await proc.wait_for("stuck")
        finally:
            proc.kill()
        await killed_session_gone(db)
    policy = RetentionPolicy(max_age=timedelta(days=1), archive_dir=tmp_path)
    result = await clean_queue(db, "nmbus", "billing", policy)
    assert result.recovered_files >= 1
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing") == 0
    archived = ds.dataset(tmp_path, format="parquet", partitioning="hive").to_table()
    ids = sorted(archived.column("id").to_pylist())
    assert ids == expected  # every row, each exactly once
    assert not await asyncio.to_thread(lambda: list(tmp_path.rglob(".pending-*")))


async def test_a_roll_killed_after_its_sequence_move_leaves_inserts_a_segment(
    dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    await make_queue(dsn)
    await add(db, 2, "I")
    # So the roll killed makes the segment it moves into itself.
    await db.execute('DROP TABLE nmbus."billing$s1"')
    proc = Proc("tests.segment_kill", dsn, str(tmp_path), "0", "after-sequence-move")
    try:
        await proc.wait_for("stuck")
    finally:
        proc.kill()
    await killed_session_gone(db)
    # The move of the sequence stays (sequences are not transactional); the
    # segment it moved into was made and committed before it, so inserts go on.
    assert await current_segment(db, "nmbus", "billing") == 1
    assert await numbers(db) == [0, 1]
    await add(db, 3, "I", prefix="after")
    assert await db.fetchval('SELECT count(*) FROM nmbus."billing$s1"') == 3
    # The next roll makes the segment ahead again and moves on, no id twice.
    assert await advance(db, "nmbus", "billing") == 2
    assert await numbers(db) == [0, 1, 2, 3]
    await add(db, 1, "I", prefix="later")
    assert await db.fetchval('SELECT count(*) FROM nmbus."billing$s2"') == 1
    floor = await read_floor(db, "nmbus", "billing")
    assert len(await db.fetch(render("claim", "nmbus", "billing"), 10, "w", 30.0, floor)) == 6


# -- the seed's SQL, and the upgrade ---------------------------------------------------------


async def test_the_seed_sql_runs_verbatim_over_segments(dsn: str, db: asyncpg.Connection) -> None:
    await make_queue(dsn)
    await add(db, 5, "X", ago="1 minute")
    await add(db, 2, "F", ago="1 minute")
    assert await advance(db, "nmbus", "billing") == 1
    await add(db, 3, "I", ago="0 seconds", prefix="new")
    await add(db, 4, "X", ago="1 minute", prefix="new")
    await db.execute("SET search_path = nmbus")
    assert await db.fetchval("select COUNT(*) from billing where subqueue='I'") == 3
    failed = await db.fetch("select * from billing where subqueue='F' order by id")
    assert len(failed) == 2 and failed[0]["id"] < SEGMENT_SPAN
    assert (
        await db.execute(f"update billing set subqueue='I' where id={failed[0]['id']}")
        == "UPDATE 1"
    )
    assert await db.fetchval("select COUNT(*) from billing where subqueue='X'") == 9
    avg = await db.fetchval(
        "select avg(extract(epoch from last_processed - retry_time) * 1000) from billing "
        "where subqueue='X' and last_processed > now() - interval '10 minutes'"
    )
    assert avg == pytest.approx(1000, abs=50)


async def test_a_schema_7_queue_is_upgraded_while_a_worker_runs(
    dsn: str, db: asyncpg.Connection
) -> None:
    await make_queue(dsn)
    await make_v9(db, "nmbus", ["billing"], version=7)
    await add(db, 3000, "I", ago="0 seconds")
    await add(db, 200, "X")
    await add(db, 5, "F")
    await add(db, 5, "R", ago="-1 day")
    ready = {r[0] for r in await db.fetch("SELECT id FROM nmbus.billing WHERE subqueue = 'I'")}
    old_file = await db.fetchval("SELECT pg_relation_filenode('nmbus.billing')")
    handled: list[int] = []
    worker = await asyncpg.connect(dsn)

    async def work() -> None:
        # The claim and a finish to X, as a running worker does them, through the upgrade.
        while True:
            try:
                rows = await worker.fetch(
                    render("claim", "nmbus", "billing"), 50, "old", 30.0, NO_FLOOR
                )
                ids = [r["id"] for r in rows]
                await worker.execute(
                    "UPDATE nmbus.billing SET subqueue = 'X', last_processed = now(), "
                    "handling_client_id = NULL, lease_expires = NULL WHERE id = ANY($1)",
                    ids,
                )
            except asyncpg.InvalidCachedStatementError:
                continue
            handled.extend(ids)
            if not ids:
                await asyncio.sleep(0.05)

    task = asyncio.create_task(work())
    try:
        await wait_until(lambda: len(handled), until=lambda n: n >= 300)
        await install_schema(db, "nmbus")
        await wait_until(lambda: len(handled), until=lambda n: n >= len(ready))
    finally:
        task.cancel()
        await worker.close()
    assert sorted(handled) == sorted(ready)  # each once, none lost
    assert await db.fetchval(KIND) == b"p"
    # The old table is segment 0, its file the same: no row was rewritten.
    assert await db.fetchval("""SELECT pg_relation_filenode('nmbus."billing$s0"')""") == old_file
    counts = dict(await db.fetch("SELECT subqueue, count(*) FROM nmbus.billing GROUP BY 1"))
    assert counts == {"X": 3200, "F": 5, "R": 5}
    # Old unique_ids are known to the new unique table; new rows go to a new segment.
    async with Bus("shop", dsn=dsn, concurrency=0) as bus:
        await bus.send(Ping(n=1), to="billing", unique_id="r-F-1")
        await bus.send(Ping(n=2), to="billing", unique_id="fresh")
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing WHERE unique_id = 'r-F-1'") == 1
    assert (
        await db.fetchval("SELECT id FROM nmbus.billing WHERE unique_id = 'fresh'") >= SEGMENT_SPAN
    )
    assert await db.fetchval(SEGMENTS_OF) == [
        'nmbus."billing$s0"',
        'nmbus."billing$s1"',
        'nmbus."billing$s2"',
    ]


# -- edges found by trying to break it ----------------------------------------------------

INSERT_ONE = "INSERT INTO nmbus.billing (from_endpoint, to_endpoint) VALUES ('a', 'b') RETURNING id"


async def test_new_rows_never_go_where_an_open_transaction_cannot_see(
    dsn: str, db: asyncpg.Connection
) -> None:
    """A transaction keeps the partitions it first saw: the roll waits for it."""
    await make_queue(dsn)
    other = await asyncpg.connect(dsn)
    try:
        tx = other.transaction()
        await tx.start()
        assert await other.fetchval(INSERT_ONE) < SEGMENT_SPAN
        assert await advance(db, "nmbus", "billing") == 1  # segment 1 was made before it
        assert await numbers(db) == [0, 1, 2]  # segment 2 made while it is open
        assert await advance(db, "nmbus", "billing") is None  # so no rows go there yet
        assert SEGMENT_SPAN <= await other.fetchval(INSERT_ONE) < 2 * SEGMENT_SPAN
        await tx.commit()
    finally:
        await other.close()
    assert await advance(db, "nmbus", "billing") == 2


async def test_a_deleted_row_frees_its_unique_id(dsn: str, db: asyncpg.Connection) -> None:
    await make_queue(dsn)
    assert await db.execute(PLAIN, "once") == "INSERT 0 1"
    assert await db.execute("DELETE FROM nmbus.billing WHERE unique_id = 'once'") == "DELETE 1"
    assert await db.execute(PLAIN, "once") == "INSERT 0 1"  # as with a unique index


async def test_a_failed_row_processed_at_no_known_time_is_kept(
    dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    await make_queue(dsn)
    await add(db, 10, "X")
    await db.execute(PLAIN, "by-hand")
    await db.execute("UPDATE nmbus.billing SET subqueue = 'F' WHERE unique_id = 'by-hand'")
    assert await advance(db, "nmbus", "billing") == 1
    policy = RetentionPolicy(
        max_age=timedelta(days=1), failed_max_age=timedelta(hours=1), archive_dir=tmp_path
    )
    result = await clean_queue(db, "nmbus", "billing", policy)
    assert result.rows_moved == 1 and result.deleted == {"X": 10, "F": 0}
    assert (
        await db.fetchval("SELECT subqueue FROM nmbus.billing WHERE unique_id = 'by-hand'") == "F"
    )


async def test_the_roll_stops_at_the_most_segments_a_queue_keeps(
    dsn: str, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("nmbus.postgres.segments.MAX_LIVE_SEGMENTS", 3)
    await make_queue(dsn)
    for expected in (1, 2):
        await add(db, 1, "X", prefix=f"s{expected}")
        await asyncio.sleep(1.1)  # a segment's time counts from when it was opened
        assert await roll(db, "nmbus", "billing", 1.0) == expected
    await add(db, 1, "X", prefix="s3")
    await asyncio.sleep(1.1)
    assert await roll(db, "nmbus", "billing", 1.0) is None  # 3 live: the third stays open
    await add(db, 1, "X", prefix="s4")
    assert await current_segment(db, "nmbus", "billing") == 2


async def _generic_plan(worker: asyncpg.Connection, name: str, args: str) -> str:
    """``EXPLAIN (ANALYZE)`` of statement ``name`` run with ``args``, as the worker's
    generic plan runs it (a worker connection plans it once, when it is prepared)."""
    await worker.execute(f"PREPARE {name} AS {render(name, 'nmbus', 'billing')}")
    rows = await worker.fetch(f"EXPLAIN (ANALYZE) EXECUTE {name}({args})")
    return "\n".join(r[0] for r in rows)


async def test_the_worker_s_generic_plans_keep_to_the_indexes(
    dsn: str, db: asyncpg.Connection
) -> None:
    await make_queue(dsn)
    await add(db, 20_000, "I", ago="0 seconds")
    assert await advance(db, "nmbus", "billing") == 1
    await add(db, 20_000, "X", prefix="done")
    await db.execute("ANALYZE nmbus.billing")
    worker = await asyncpg.connect(dsn, server_settings=WORKER_SERVER_SETTINGS)
    try:
        claimed = [
            r[0]
            for r in await worker.fetch(
                render("claim", "nmbus", "billing"), 100, "w", 30.0, NO_FLOOR
            )
        ]
        for name, args in (
            ("claim", f"100, 'w', 30.0, {NO_FLOOR}"),
            ("finish_processed", f"ARRAY{claimed}::bigint[], 'w'"),
            (
                "finish_claim_processed",
                f"ARRAY{claimed}::bigint[], 'w', 100, 30.0, {NO_FLOOR}, 'w2'",
            ),
        ):
            plan = await _generic_plan(worker, name, args)
            assert 'Seq Scan on "billing$s0"' not in plan, plan
            assert 'Seq Scan on "billing$s1"' not in plan, plan
    finally:
        await worker.close()


@pytest.mark.parametrize("rested", [False, True], ids=["new", "at-rest"])
async def test_a_claim_over_a_burst_no_analyze_has_seen_joins_no_row_to_every_other(
    dsn: str, db: asyncpg.Connection, rested: bool
) -> None:
    # A burst into a new queue (never analyzed), or into one at rest (its rows all
    # processed when last analyzed): either way the planner expects a claim to
    # find a row or two, and no analyze has seen the burst yet.
    await make_queue(dsn)
    if rested:
        await add(db, 20_000, "X", prefix="done")
        await db.execute("ANALYZE nmbus.billing")
    await add(db, 20_000, "I", ago="0 seconds", prefix="burst")
    worker = await asyncpg.connect(dsn, server_settings=WORKER_SERVER_SETTINGS)
    try:
        calls = (
            ("claim", f"500, 'w', 30.0, {NO_FLOOR}"),
            ("finish_claim_processed", f"ARRAY[]::bigint[], 'w', 500, 30.0, {NO_FLOOR}, 'w2'"),
        )
        for name, args in calls:
            plan = await _generic_plan(worker, name, args)
            # The lease is written by id, in one scan of the primary key, not through
            # a join with the rows the claim took: planned for two rows, that join
            # ran once per row of the batch (an index probe each, or a comparison
            # with every other row over a materialized side).
            assert "loops=500" not in plan, plan
            assert "Rows Removed by Join Filter" not in plan, plan
    finally:
        await worker.close()
