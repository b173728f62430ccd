"""Retention: exactly the old segments go, whole, archived without loss.

Most tests put the rows they expect removed into an old segment of their own
(split_segments), since processed rows go only with their segment.
"""

from __future__ import annotations

import asyncio
import json
import os
from datetime import UTC, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from nmbus import Bus
from nmbus.ports.operations import RetentionPolicy
from nmbus.postgres.retention import (
    ARCHIVE_COLUMNS,
    archive_schema,
    clean_queue,
    publish,
    recover,
    write_pending,
)
from nmbus.postgres.sql import render
from tests import retention_bench as bench
from tests.ops_data import populate, split_segments
from tests.procs import Proc
from tests.waits import wait_until

ALL = "SELECT * FROM nmbus.billing ORDER BY id"
OLD = "subqueue = 'X' AND last_processed < now() - interval '12 hours'"
# Every archived column (test_the_archive_holds_every_column_of_the_queue_table
# checks that they are the table's), headers as the JSON text the archive holds.
PICK = (
    "SELECT "
    + ", ".join(
        "msg_headers::text AS msg_headers" if c == "msg_headers" else c for c in ARCHIVE_COLUMNS
    )
    + " FROM nmbus.billing WHERE {} ORDER BY id"
)


async def ids(db: asyncpg.Connection, where: str = "true", *args: object) -> set[int]:
    return {r[0] for r in await db.fetch(f"SELECT id FROM nmbus.billing WHERE {where}", *args)}


def found(root: Path, pattern: str) -> list[Path]:
    return sorted(root.rglob(pattern))


async def test_deletes_exactly_the_old_processed_rows(db: asyncpg.Connection) -> None:
    await populate(db)
    await split_segments(db, OLD)
    before = await ids(db)
    old = await ids(db, OLD)
    assert len(old) == 65
    untouched = await db.fetch("SELECT * FROM nmbus.billing WHERE NOT (id = ANY($1)) ORDER BY id",
                               list(old))  # fmt: skip
    # Segment 0 holds the old rows only; segment 1 mixes recent X rows with I/R/F.
    policy = RetentionPolicy(max_age=timedelta(hours=12), batch_size=7)
    result = await clean_queue(db, "nmbus", "billing", policy)
    assert result.deleted == {"X": 65, "F": 0}
    assert (result.segments_dropped, result.rows_moved, result.segments_pinned) == (1, 0, 0)
    assert await db.fetchval("SELECT to_regclass('nmbus.\"billing$s0\"')") is None
    assert await ids(db) == before - old
    # Every row left is exactly as it was: I, R, F and the recent X rows.
    assert await db.fetch(ALL) == untouched
    again = await clean_queue(db, "nmbus", "billing", policy)
    assert again.total == 0


async def test_failed_rows_stay_unless_configured(db: asyncpg.Connection) -> None:
    await populate(db)
    await db.execute("UPDATE nmbus.billing SET lease_expires = now() - interval '1 minute'")
    await split_segments(db, "true")  # every row in an old segment
    failed = await db.fetch("SELECT * FROM nmbus.billing WHERE subqueue = 'F' ORDER BY id")
    keep = RetentionPolicy(max_age=timedelta(0))
    result = await clean_queue(db, "nmbus", "billing", keep)
    # The F (and I/R) rows moved to the segment being written, every column but the id kept.
    # Segment 0 with its rows, and the empty segment 1 that split_segments skipped.
    assert result.segments_dropped == 2 and result.rows_moved == 3 + 9
    moved = await db.fetch("SELECT * FROM nmbus.billing WHERE subqueue = 'F' ORDER BY id")
    assert [dict(r, id=0) for r in moved] == [dict(r, id=0) for r in failed]
    assert all(r["id"] > f["id"] for r, f in zip(moved, failed, strict=True))
    failed = await ids(db, "subqueue = 'F'")
    assert await ids(db, "subqueue = 'X'") == set()
    # F rows failed 50, 40 and 30 minutes ago; remove those older than 35 minutes.
    policy = RetentionPolicy(max_age=timedelta(days=1), failed_max_age=timedelta(minutes=35))
    result = await clean_queue(db, "nmbus", "billing", policy)
    assert result.deleted == {"X": 0, "F": 2}
    assert await ids(db, "subqueue = 'F'") == {max(failed)}
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing WHERE subqueue IN ('I','R')") == 9


async def test_one_run_per_queue(dsn: str, db: asyncpg.Connection) -> None:
    await populate(db)
    other = await asyncpg.connect(dsn)
    try:
        key = "nmbus.retention.nmbus.billing"
        assert await other.fetchval(render("retention_lock", "nmbus"), key)
        result = await clean_queue(db, "nmbus", "billing", RetentionPolicy(max_age=timedelta(0)))
        assert result.skipped and result.total == 0
        assert await ids(db, "subqueue = 'X'")
    finally:
        await other.close()


def read_archive(root: Path) -> pa.Table:
    table = ds.dataset(root, format="parquet", partitioning="hive").to_table()
    return table.sort_by("id") if table.num_rows else table


async def test_archive_then_delete_loses_no_row(db: asyncpg.Connection, tmp_path: Path) -> None:
    await populate(db)
    where = "subqueue = 'X' AND last_processed < now() - interval '12 hours'"
    await split_segments(db, where)
    expected = await db.fetch(PICK.format(where))
    policy = RetentionPolicy(max_age=timedelta(hours=12), batch_size=9, archive_dir=tmp_path)
    result = await clean_queue(db, "nmbus", "billing", policy)
    assert result.deleted["X"] == len(expected) == 65
    assert await ids(db, where) == set()
    # Layout agreed with the statistics job; no pending file left behind.
    files = found(tmp_path, "*.parquet")
    assert files == sorted(result.files)
    days = {r["last_processed"].astimezone(UTC).date().isoformat() for r in expected}
    assert {f.parent.relative_to(tmp_path).as_posix() for f in files} == {
        f"queue=billing/day={d}" for d in days
    }
    assert not found(tmp_path, ".pending-*")
    for f in files:
        table = pa.parquet.read_table(f)
        assert table.schema.equals(archive_schema())
        assert table.column_names == list(ARCHIVE_COLUMNS)
        day = f.parent.name.removeprefix("day=")
        assert {t.date().isoformat() for t in table.column("last_processed").to_pylist()} == {day}
    # The files hold exactly the deleted rows, column for column.
    archived = read_archive(tmp_path)
    assert archived.column("id").to_pylist() == [r["id"] for r in expected]
    for name in ARCHIVE_COLUMNS:
        got = archived.column(name).to_pylist()
        want = [r[name] for r in expected]
        assert got == want, name
    assert archive_schema().field("insert_time").type == pa.timestamp("us", tz="UTC")
    assert json.loads(archived.column("msg_headers")[0].as_py()) == {"tenant": "acme"}


async def test_a_crash_mid_batch_is_settled_by_the_next_run(
    db: asyncpg.Connection, tmp_path: Path
) -> None:
    await populate(db)
    rows = await db.fetch(PICK.format("subqueue = 'X' ORDER BY id LIMIT 20 --"))
    committed, rolled_back = rows[:10], rows[10:]
    # Died after the delete committed, before the rename: the file must be published.
    pending_done = write_pending(tmp_path, "billing", committed)
    await db.execute("DELETE FROM nmbus.billing WHERE id = ANY($1)", [r["id"] for r in committed])
    # Died before the delete committed: the rows are still there, the file must go.
    pending_lost = write_pending(tmp_path, "billing", rolled_back)
    assert all(p.name.startswith(".pending-") for p in pending_done + pending_lost)
    assert read_archive(tmp_path).num_rows == 0  # readers never see pending files
    assert await recover(db, "nmbus", "billing", tmp_path) == 2
    assert not found(tmp_path, ".pending-*")
    assert read_archive(tmp_path).column("id").to_pylist() == [r["id"] for r in committed]
    assert publish([]) == []


# -- a run killed while it writes, and the archive's columns (issue 23, defect 15) ------


async def advisory_locks(db: asyncpg.Connection) -> int:
    return int(
        await db.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
    )


@pytest.mark.parametrize("mode", ["empty", "torn"])
async def test_a_run_killed_while_writing_a_file_never_blocks_the_next_run(
    dsn: str, db: asyncpg.Connection, tmp_path: Path, mode: str
) -> None:
    await populate(db)
    await split_segments(db, OLD)
    expected = [r["id"] for r in await db.fetch(PICK.format(OLD))]
    assert len(expected) > 9
    # The run stops inside its first write, the pending file empty or cut in
    # half (and synced), and is killed there.
    proc = Proc("tests.retention_kill", dsn, str(tmp_path), str(12 * 3600), "9", mode)
    try:
        line = await proc.wait_for("stuck ")
    finally:
        proc.kill()
    stuck = Path(line.split(" ", 1)[1])
    assert stuck.name.startswith(".pending-")
    size = await asyncio.to_thread(os.path.getsize, stuck)
    assert size == 0 if mode == "empty" else size > 0
    assert await ids(db, OLD) == set(expected)  # the killed run deleted nothing
    # The server ends the dead run's session, and with it its lock.
    await wait_until(lambda: advisory_locks(db), until=lambda locks: not locks)

    policy = RetentionPolicy(max_age=timedelta(hours=12), batch_size=9, archive_dir=tmp_path)
    result = await clean_queue(db, "nmbus", "billing", policy)
    assert result.recovered_files == 1
    assert result.deleted["X"] == len(expected)
    assert await ids(db, OLD) == set()
    assert not found(tmp_path, ".pending-*")
    # Every removed row archived, each exactly once.
    assert read_archive(tmp_path).column("id").to_pylist() == expected
    assert sorted(result.files) == found(tmp_path, "*.parquet")


async def test_a_write_that_fails_leaves_no_half_file(
    db: asyncpg.Connection, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await populate(db)
    rows = await db.fetch(PICK.format(OLD))

    def broken(table: pa.Table, where: Any, **kwargs: Any) -> None:
        where.write(b"PAR1 and then the disk was full")
        raise OSError("No space left on device")

    monkeypatch.setattr(pq, "write_table", broken)
    with pytest.raises(OSError, match="No space"):
        write_pending(tmp_path, "billing", rows)
    assert found(tmp_path, "*.parquet") == []


async def test_the_archive_holds_every_column_of_the_queue_table(
    db: asyncpg.Connection, tmp_path: Path
) -> None:
    await populate(db)
    await split_segments(db, OLD)
    # Every column holds something, so a column left out would show.
    await db.execute(
        "UPDATE nmbus.billing SET priority = 7, sequence_key = 'acct-' || id, "
        "expires_at = last_processed + interval '1 day', isolated = (id % 2 = 0), "
        "correlation_id = 'c-' || id, handling_client_id = 'w1', "
        f"lease_expires = last_processed WHERE {OLD}"
    )
    catalog = await db.fetch(
        "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
        "WHERE attrelid = 'nmbus.billing'::regclass AND attnum > 0 AND NOT attisdropped "
        "ORDER BY attnum"
    )
    assert len(catalog) == len(ARCHIVE_COLUMNS)
    expected = await db.fetch(PICK.format(OLD))
    policy = RetentionPolicy(max_age=timedelta(hours=12), batch_size=50, archive_dir=tmp_path)
    await clean_queue(db, "nmbus", "billing", policy)
    archived = read_archive(tmp_path)
    ts = pa.timestamp("us", tz="UTC")
    as_parquet = {
        "bigint": pa.int64(),
        "integer": pa.int32(),
        "smallint": pa.int16(),
        "boolean": pa.bool_(),
        "timestamp with time zone": ts,
        "text": pa.string(),
        "character(1)": pa.string(),
        "jsonb": pa.string(),  # as JSON text
    }
    for f in found(tmp_path, "*.parquet"):
        schema = pq.read_schema(f)
        assert [(n.name, n.type) for n in schema] == [
            (name, as_parquet[kind]) for name, kind in catalog
        ]
    for name, _ in catalog:
        assert archived.column(name).to_pylist() == [r[name] for r in expected], name
    assert set(archived.column("priority").to_pylist()) == {7}


async def test_cli_sized_run_never_blocks_a_conflicting_lock_for_long(dsn: str) -> None:
    """The million-row measurement of docs/operations.md, on a CI-sized table.

    A probe keeps taking a SHARE lock (which waits for any retention batch in
    progress) and another keeps claiming; the longest wait of each is recorded.
    """
    conn = await asyncpg.connect(dsn)
    try:
        await bench.fill(conn, 30_000, ready=200)
    finally:
        await conn.close()
    policy = RetentionPolicy(max_age=timedelta(days=1), batch_size=1000)
    result, locks, claims, _ = await bench.measure(dsn, policy, lock_timeout=5.0)
    assert result.deleted["X"] == 30_000
    assert result.segments_dropped == 1
    # The probe really ran while retention did: it saw the table before and after.
    assert {0, 30_000} <= set(locks.seen_counts)
    assert locks.timeouts == 0 and claims.timeouts == 0
    assert locks.longest < 1.0, f"a SHARE lock waited {locks.longest:.3f}s"
    assert claims.longest < 1.0, f"a claim waited {claims.longest:.3f}s"
    conn = await asyncpg.connect(dsn)
    try:
        left = await conn.fetchrow(
            f"SELECT count(*) FILTER (WHERE subqueue = 'X'), count(*) FILTER (WHERE subqueue = 'I')"
            f' FROM nmbus."{bench.QUEUE}"'
        )
        assert tuple(left) == (0, 200)
    finally:
        await conn.close()


@pytest.mark.parametrize("archive", [False, True])
async def test_retention_runs_inside_a_worker_on_a_schedule(
    dsn: str, db: asyncpg.Connection, tmp_path: Path, archive: bool
) -> None:
    await populate(db)
    await split_segments(db, "subqueue = 'X' AND last_processed < now() - interval '7 days'")
    old = await ids(db, "subqueue = 'X' AND last_processed < now() - interval '7 days'")
    assert len(old) == 5
    bus = Bus(
        "billing",
        dsn=dsn,
        poll_interval=2.0,
        retention_interval=0.2,
        retention_archive_dir=str(tmp_path) if archive else None,
    )
    async with bus:
        await wait_until(
            lambda: ids(db, "id = ANY($1)", list(old)), until=lambda left: not left, interval=0.1
        )
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing WHERE subqueue = 'X'") == 160
    if archive:
        assert set(read_archive(tmp_path).column("id").to_pylist()) == old
