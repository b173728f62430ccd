"""Reclaim old segments whole: move what still waits, archive, drop.

Retention's pass over a segmented queue (docs/storage.md, "Segments"). The
segment being written is never dropped; when its processed rows are already
past ``max_age`` and nothing else keeps it, :func:`roll_ripe` rolls it first,
so that it is an old segment by the time this pass looks. For each segment
older than the one being written, lowest first:

1. if it holds an X row processed less than ``max_age`` ago, it stays;
2. rows that wait for something other than time are moved to the segment
   being written, with a new id and every other column kept: F rows younger
   than ``failed_max_age`` (all of them when it is None) and I/R rows no live
   lease holds. So an old failed row waits for its operator without keeping
   its segment's processed rows alive. Sequence members never move (their id
   is their place in the sequence); they keep their segment until they are
   done, and so does a row a worker holds;
3. with an archive folder, every row is written to Parquet as hidden pending
   files (retention's protocol, nmbus.postgres.retention);
4. in one short transaction the queue table is locked (waiting at most
   LOCK_TIMEOUT, so workers wait at most that long behind it), the segment
   is checked again by index probes and dropped: its files go back to the
   operating system, and no row is deleted one by one;
5. the pending files are published, and the segment's entries in the unique
   table are deleted (narrow rows, in batches).

A crash anywhere leaves nothing lost and nothing archived twice: pending
files are settled by retention's recovery (the segment is gone: publish; its
rows are all there: discard), and unique entries of a dropped segment are
deleted by the next run (they only keep a unique_id taken a little longer).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import asyncpg
import structlog

from nmbus.errors import RetentionError
from nmbus.ports.operations import ProgressCallback, RetentionPolicy, RetentionResult
from nmbus.postgres.archive import publish, write_pending
from nmbus.postgres.segments import (
    LOWEST_ID,
    Segment,
    current_segment,
    full,
    roll_now,
    segment_regclass,
    segments,
    take_segment_lock,
)
from nmbus.postgres.sql import render, render_segment

log = structlog.get_logger("nmbus.retention")

#: Rows per archive file written from one segment (bounded memory per file).
ARCHIVE_CHUNK = 50_000


async def roll_ripe(conn: Any, schema: str, queue: str, policy: RetentionPolicy) -> int | None:
    """Roll the segment being written if it holds X rows past ``max_age`` and nothing
    that would keep it anyway (segment_ripe), so that the drops that follow take it.

    Returns the number of the segment now written if it rolled, else None: nothing
    past the age, something that keeps it, the queue at MAX_LIVE_SEGMENTS (the caller
    tries again once its drops have made room), or a roll that could not go now
    (nmbus.postgres.segments.advance: a lock busy, a transaction older than the next
    segment still open).
    """
    present = await segments(conn, schema, queue)
    current = await current_segment(conn, schema, queue)
    if not any(s.number == current for s in present) or full(present, current):
        return None
    ripe = render_segment("segment_ripe", schema, queue, current)
    if not await conn.fetchval(ripe, policy.max_age):
        return None
    return await roll_now(conn, schema, queue)


async def reclaim_segments(
    conn: Any,
    schema: str,
    queue: str,
    policy: RetentionPolicy,
    result: RetentionResult,
    on_batch: ProgressCallback | None = None,
) -> None:
    """Drop the segments of ``queue`` whose rows are all done and old enough."""
    current = await current_segment(conn, schema, queue)
    present = await segments(conn, schema, queue)
    for segment in present:
        if segment.number >= current:
            break
        started = time.perf_counter()
        reclaimed = await _reclaim(conn, schema, queue, segment, policy, result)
        if reclaimed is None:
            continue
        dropped, size = reclaimed
        elapsed = time.perf_counter() - started
        result.segments_dropped += 1
        result.bytes_freed += size
        for subqueue, count in dropped.items():
            result.deleted[subqueue] += count
        result.batches += 1
        result.longest_batch_seconds = max(result.longest_batch_seconds, elapsed)
        if on_batch is not None:
            on_batch(queue, sum(dropped.values()))
    await forget_unique(conn, schema, queue)


async def _reclaim(
    conn: Any,
    schema: str,
    queue: str,
    segment: Segment,
    policy: RetentionPolicy,
    result: RetentionResult,
) -> tuple[dict[str, int], int] | None:
    """Drop one segment if nothing keeps it; returns its X and F rows and the bytes it
    took on disk, None if kept."""
    n = segment.number
    if await _pins(conn, schema, queue, n, policy, recent_only=True):
        return None
    result.rows_moved += await _move_waiting(conn, schema, queue, n, policy)
    if await _pins(conn, schema, queue, n, policy):
        result.segments_pinned += 1
        return None
    pending: list[Path] = []
    rows: dict[str, int] = {"X": 0, "F": 0}
    size = 0
    try:
        if policy.archive_dir is not None:
            try:
                pending, rows = await _archive(conn, schema, queue, n, policy)
            except _Kept:  # a row came back to life since the probes: next run
                result.segments_pinned += 1
                return None
        else:
            # Counted before the lock (an index-only read of the done index):
            # rows only leave an old segment, and a drop with any other row left is refused.
            counted = await conn.fetchrow(render_segment("segment_count", schema, queue, n))
            rows = {"X": int(counted["x"]), "F": int(counted["f"])}
        try:
            async with conn.transaction():
                await take_segment_lock(conn, schema, queue)
                await conn.execute(render("segment_lock_queue", schema, queue))
                if await _pins(conn, schema, queue, n, policy):
                    raise _Kept
                size = await conn.fetchval(
                    render("segment_size", schema), segment_regclass(schema, queue, n)
                )
                await conn.execute(render_segment("segment_drop", schema, queue, n))
        except (_Kept, asyncpg.LockNotAvailableError) as exc:
            for path in pending:
                path.unlink(missing_ok=True)
            if isinstance(exc, asyncpg.LockNotAvailableError):
                log.info("segment_drop_deferred", queue=queue, segment=n, reason="queue busy")
            return None
    except BaseException:
        # Before the drop committed: its files are discarded (here, or by recovery).
        for path in pending:
            path.unlink(missing_ok=True)
        raise
    result.files.extend(await asyncio.to_thread(publish, pending))
    log.info("segment_dropped", queue=queue, segment=n, rows=rows, bytes=size, files=len(pending))
    return rows, int(size)


class _Kept(Exception):
    """The segment gained a row that keeps it between the archive and the drop."""


async def _pins(
    conn: Any, schema: str, queue: str, n: int, policy: RetentionPolicy, recent_only: bool = False
) -> bool:
    row = await conn.fetchrow(
        render_segment("segment_pins", schema, queue, n), policy.max_age, policy.failed_max_age
    )
    if recent_only:
        return bool(row["recent"])
    return any(row.values())


async def _move_waiting(conn: Any, schema: str, queue: str, n: int, policy: RetentionPolicy) -> int:
    moved = 0
    while True:
        async with conn.transaction():
            rows = await conn.fetch(
                render_segment("segment_movable", schema, queue, n),
                policy.failed_max_age,
                policy.batch_size,
            )
            if not rows:
                return moved
            await conn.execute(
                render("segment_release_unique", schema, queue),
                [r["unique_id"] for r in rows],
                [r["id"] for r in rows],
            )
            count = await conn.fetchval(
                render("segment_move", schema, queue), [r["id"] for r in rows]
            )
            if count != len(rows):
                raise RetentionError(
                    f"{queue}: moving {len(rows)} waiting rows out of segment {n} "
                    f"stored {count}; nothing moved"
                )
        moved += int(count)
        log.info("segment_rows_moved", queue=queue, segment=n, rows=count)
        if len(rows) < policy.batch_size:
            return moved


async def _archive(
    conn: Any, schema: str, queue: str, n: int, policy: RetentionPolicy
) -> tuple[list[Path], dict[str, int]]:
    """Write every row of segment ``n`` to pending files; refuse a row that must stay."""
    assert policy.archive_dir is not None
    now = await conn.fetchval("SELECT now()")
    x_cut = now - policy.max_age
    f_cut = None if policy.failed_max_age is None else now - policy.failed_max_age
    pending: list[Path] = []
    rows = {"X": 0, "F": 0}
    try:
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            cursor = await conn.cursor(render_segment("segment_rows", schema, queue, n))
            while chunk := await cursor.fetch(ARCHIVE_CHUNK):
                for row in chunk:
                    when = row["last_processed"]  # NULL: processed at an unknown time
                    done = row["subqueue"] == "X" and when is not None and when < x_cut
                    failed = row["subqueue"] == "F" and f_cut is not None
                    failed = failed and when is not None and when < f_cut
                    if not (done or failed):
                        raise _Kept
                    rows[row["subqueue"]] += 1
                pending.extend(
                    await asyncio.to_thread(write_pending, policy.archive_dir, queue, chunk)
                )
    except BaseException:
        for path in pending:
            path.unlink(missing_ok=True)
        raise
    return pending, rows


async def due(conn: Any, schema: str, queue: str, policy: RetentionPolicy) -> tuple[int, int]:
    """What a run would remove now: (X rows of the segments it would drop, F rows past
    ``failed_max_age``). Read only; a segment counts unless a recent X row or a
    sequence member not done keeps it (what a run moves first is not counted). The
    segment being written counts too: a run rolls it first when its X rows are past
    the age and nothing of that keeps it (roll_ripe), and then drops it."""
    current = await current_segment(conn, schema, queue)
    processed = 0
    for segment in await segments(conn, schema, queue):
        if segment.number > current:
            break
        pins = await conn.fetchrow(
            render_segment("segment_pins", schema, queue, segment.number),
            policy.max_age,
            policy.failed_max_age,
        )
        if not (pins["recent"] or pins["sequenced"]):
            counted = await conn.fetchrow(
                render_segment("segment_count", schema, queue, segment.number)
            )
            processed += int(counted["x"])
    row = await conn.fetchrow(
        render("retention_count", schema, queue), policy.max_age, policy.failed_max_age
    )
    return processed, int(row[1])


async def forget_unique(conn: Any, schema: str, queue: str) -> int:
    """Delete unique-table entries of ids in no segment (dropped ones); returns how many."""
    present = await segments(conn, schema, queue)
    if not present:
        return 0
    gaps: list[tuple[int, int]] = []
    low = LOWEST_ID
    for segment in present:
        if segment.lower > low:
            gaps.append((low, segment.lower))
        low = segment.upper
    gone = 0
    for lo, hi in gaps:
        gone += int(await conn.fetchval(render("segment_forget_unique", schema, queue), lo, hi))
    return gone
