"""Segments: a queue table's partitions by ranges of id, rolled ahead and dropped whole.

Seed 002's store frees a segment once every message in it is consumed; nmbus
does the same with PostgreSQL's declarative partitions (docs/storage.md,
"Segments"). Segment n of a queue holds the ids from ``n * SEGMENT_SPAN`` up
to ``(n + 1) * SEGMENT_SPAN``; rows never move between segments by an update
(a finish changes no id), so a claim never meets a row moved away under it.

Who writes where:

* every insert takes the next value of the queue's identity sequence, so it
  goes to the segment that value falls in: the segment being written;
* :func:`roll` (run by retention) makes sure the segment after it exists,
  and once the segment being written holds a row older than
  ``segment_seconds`` it moves the sequence to the next segment's first id;
  :func:`roll_now` moves it whatever that age (retention's roll of a segment
  whose processed rows are already past their age, so that the same run can
  drop it). The next segment is always created, and committed, before the
  sequence moves into it, so no insert ever lacks a segment; a queue whose
  retention never runs simply keeps writing into one segment.

Retention drops old segments whole (nmbus.postgres.reclaim), never the one
being written.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import structlog

from nmbus.postgres.sql import (
    OPENED_NOTE,
    SEGMENT_SPAN,
    quote_ident,
    render,
    render_segment,
    segment_name,
)

log = structlog.get_logger("nmbus.segments")

#: The most segments a queue keeps below the one being written plus it: each live
#: segment adds about 5 relations to every lock a worker's statement takes (its
#: table and 4 indexes), and PostgreSQL's lock table is shared by the server.
#: Beyond it the roll waits (the segment being written grows past segment_seconds).
MAX_LIVE_SEGMENTS = 16
#: How the comment of a segment made ahead says when it was attached.
MADE_NOTE = "nmbus: made "

#: The longest a roll or a drop waits for the queue table's lock before it gives
#: up until the next run; workers wait at most this long behind it.
LOCK_TIMEOUT = "200ms"


#: The lowest bigint: where segment 0 begins.
LOWEST_ID = -(2**63)


@dataclass(frozen=True)
class Segment:
    """One segment of a queue: its number, table name and id range."""

    number: int
    name: str
    note: str | None = None

    @property
    def lower(self) -> int:
        """The lowest id it holds (segment 0: the lowest bigint)."""
        return LOWEST_ID if self.number == 0 else self.number * SEGMENT_SPAN

    @property
    def upper(self) -> int:
        return (self.number + 1) * SEGMENT_SPAN


def live_segments(present: list[Segment], current: int) -> int:
    """How many of ``present`` count against MAX_LIVE_SEGMENTS: those up to the one
    being written (``current``), not the one made ahead."""
    return sum(1 for s in present if s.number <= current)


def full(present: list[Segment], current: int) -> bool:
    """Whether the queue keeps MAX_LIVE_SEGMENTS already: then no roll moves on."""
    return live_segments(present, current) >= MAX_LIVE_SEGMENTS


def segment_of(row_id: int) -> int:
    """The number of the segment an id falls in."""
    return max(0, int(row_id) // SEGMENT_SPAN)


def queue_regclass(schema: str, queue: str) -> str:
    return f"{quote_ident(schema)}.{quote_ident(queue)}"


def segment_regclass(schema: str, queue: str, number: int) -> str:
    """Segment ``number`` of ``queue``, schema-qualified and quoted (as regclass text)."""
    return f"{quote_ident(schema)}.{quote_ident(segment_name(queue, number))}"


async def bound_lock_wait(conn: Any, schema: str, timeout: str) -> None:
    """In the caller's transaction, give up on a lock not had within ``timeout``.

    A lock that waits longer raises ``asyncpg.LockNotAvailableError``.
    """
    await conn.execute(render("bound_lock_wait", schema), timeout)


async def take_segment_lock(conn: Any, schema: str, queue: str) -> None:
    """In the caller's transaction: bound every lock wait by LOCK_TIMEOUT, then take
    the queue's segment lock (the roll's and the drop's; released at the commit)."""
    await bound_lock_wait(conn, schema, LOCK_TIMEOUT)
    await conn.execute(render("advisory_lock", schema), lock_key(schema, queue))


async def create_segment(conn: Any, schema: str, queue: str, number: int) -> None:
    """Create segment ``number`` of ``queue`` unless it exists (in the caller's transaction)."""
    await conn.execute(render("create_segment", schema), schema, queue, int(number))


async def segments(conn: Any, schema: str, queue: str) -> list[Segment]:
    """The segments of ``queue``, lowest first (none for a table not partitioned)."""
    rows = await conn.fetch(render("segment_list", schema), queue_regclass(schema, queue))
    return [Segment(int(r["number"]), r["name"], r["note"]) for r in rows]


async def current_segment(conn: Any, schema: str, queue: str) -> int:
    """The number of the segment being written: the one the next id falls in."""
    return segment_of(await conn.fetchval(render("segment_next_id", schema, queue)))


async def roll(conn: Any, schema: str, queue: str, segment_seconds: float) -> int | None:
    """Keep a segment ready ahead of the one being written; move on when it is full of time.

    The segment being written is full of time once its first row is
    ``segment_seconds`` old. Returns the number of the segment now written if
    the roll moved to it, else None. ``conn`` must not be inside a
    transaction. A roll that cannot get the queue's lock within LOCK_TIMEOUT
    tries again on the next run.
    """
    return await advance(conn, schema, queue, older_than=segment_seconds, capped=True)


async def roll_now(conn: Any, schema: str, queue: str) -> int | None:
    """Move on now, whatever the age of the segment being written, within the segments
    a queue keeps (MAX_LIVE_SEGMENTS) like :func:`roll`. Returns what :func:`roll` does.
    """
    return await advance(conn, schema, queue, capped=True)


async def advance(
    conn: Any, schema: str, queue: str, older_than: float | None = None, capped: bool = False
) -> int | None:
    """Move the queue's new rows to the next segment (only if the one being written
    has a row ``older_than`` seconds, when given, and, when ``capped``, only while
    the queue has fewer than MAX_LIVE_SEGMENTS up to it). Returns the new segment's
    number, or None when it did not move (nothing old enough, too many segments, or a
    lock it needed was busy for longer than LOCK_TIMEOUT: then nothing changed).
    """
    try:
        return await _advance(conn, schema, queue, older_than, capped)
    except asyncpg.LockNotAvailableError:
        log.info("segment_roll_deferred", queue=queue, reason="queue table busy")
        return None


async def _ahead(conn: Any, schema: str, queue: str) -> int:
    """Create the segment after the one being written, under the queue's segment lock."""
    async with conn.transaction():
        await take_segment_lock(conn, schema, queue)
        current = await current_segment(conn, schema, queue)
        await create_segment(conn, schema, queue, current + 1)
    return current


async def _advance(
    conn: Any, schema: str, queue: str, older_than: float | None, capped: bool
) -> int | None:
    # The next segment first, committed before any id can fall in it.
    await _ahead(conn, schema, queue)
    async with conn.transaction():
        await take_segment_lock(conn, schema, queue)
        current = await current_segment(conn, schema, queue)
        now: datetime = await conn.fetchval("SELECT now()")
        present = await segments(conn, schema, queue)
        if older_than is not None:
            start = await _started(conn, schema, queue, current)
            if start is None or now - start < timedelta(seconds=older_than):
                return None
        if capped and full(present, current):
            log.warning(
                "segments_capped",
                queue=queue,
                segments=live_segments(present, current),
                reason="the segment being written stays open: retention_max_age / "
                "segment_seconds is more than the segments a queue keeps",
            )
            return None
        following = next((s for s in present if s.number == current + 1), None)
        if following is None:
            return None  # dropped by hand since: the next run creates it again
        # A transaction that began before the next segment was attached may
        # not see it (its partitions are read once): new rows go there only
        # once no such transaction is open, never into a segment one cannot find.
        made = _noted(following.note, MADE_NOTE)
        oldest = await conn.fetchval(render("segment_oldest_transaction", schema))
        if made is not None and oldest is not None and oldest <= made:
            log.info(
                "segment_roll_waits",
                queue=queue,
                reason="a transaction older than the next segment is open",
            )
            return None
        # The note first: it waits for the segment's lock (bounded) and goes with
        # the transaction, while the move of the sequence below is kept even if
        # the transaction is not (sequences are not transactional).
        await conn.execute(render_segment("segment_opened", schema, queue, current + 1, now))
        # Forward only: under the lock, from the segment the sequence is in now.
        await conn.fetchval(
            render("segment_advance", schema),
            (current + 1) * SEGMENT_SPAN,
            queue_regclass(schema, queue),
        )
    # The move is committed: whatever happens to the segment ahead, this rolled.
    try:
        await _ahead(conn, schema, queue)
    except asyncpg.LockNotAvailableError:
        # The next run makes it, before it moves again (its first step).
        log.info("segment_ahead_deferred", queue=queue, reason="queue table busy")
    log.debug("segment_rolled", queue=queue, segment=current + 1)
    return current + 1


async def _started(conn: Any, schema: str, queue: str, number: int) -> datetime | None:
    """Since when segment ``number`` holds rows: its first row's insert_time, or, if
    later, when new rows started to go to it (rows moved into it keep an older
    insert_time). None while it is empty."""
    first: datetime | None = await conn.fetchval(
        render_segment("segment_oldest", schema, queue, number)
    )
    if first is None:
        return None
    for segment in await segments(conn, schema, queue):
        if segment.number == number:
            opened = _noted(segment.note, OPENED_NOTE)
            return first if opened is None else max(first, opened)
    return first


def _noted(note: str | None, prefix: str) -> datetime | None:
    """The time a segment's comment notes after ``prefix``; None if it notes none
    (no comment, another one, or one changed by hand)."""
    if not note or not note.startswith(prefix):
        return None
    try:
        return datetime.fromisoformat(note.removeprefix(prefix))
    except ValueError:
        return None


def lock_key(schema: str, queue: str) -> str:
    return f"nmbus.segments.{schema}.{queue}"
