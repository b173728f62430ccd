"""Retention: remove old processed rows, optionally archived first.

A queue table keeps every processed (X) row for the statistics job until it is
older than ``retention_max_age``; failed (F) rows stay until an operator acts,
unless ``retention_failed_max_age`` is set.

A segmented queue (schema 10, docs/storage.md "Segments") loses its X rows
with their segments, dropped whole by nmbus.postgres.reclaim, and then rolls
to its next segment (nmbus.postgres.segments). The segment being written is
never dropped: when its X rows are already past ``retention_max_age`` (a queue
no run has rolled for longer than that, or a run with a shorter age than the
segments' width), it is rolled first, so that the same run drops it instead of
the next one. What is left to remove row by
row is the F rows past ``retention_failed_max_age`` that sit in segments kept
for other reasons, and the X rows of a table not segmented; that is done in
batches, and never holds a long lock:

* the table is walked in windows of ids (``10 * batch_size`` ids each), so no
  statement scans more than one window of the primary key;
* each batch is its own short transaction that locks at most ``batch_size``
  X/F rows (``FOR UPDATE SKIP LOCKED``) and the table in ROW EXCLUSIVE mode,
  the same mode the workers' claim takes, so claims never wait for it;
* one run per queue at a time (a session advisory lock; behind a transaction
  pooler, the same lock held by an open transaction on a connection of its
  own, ``holder``), so two runs never archive the same rows.

With an archive directory, each batch is written to Parquet before it is
deleted, in the layout the statistics job reads::

    <archive_dir>/queue=<name>/day=<YYYY-MM-DD>/<part>.parquet

(``day`` is the UTC day of ``last_processed``; columns are exactly the queue
table's, ``msg_headers`` as JSON text, timestamps as UTC timestamps.) The
protocol loses no row and archives none twice, even when the process dies:

1. lock the batch's rows, write them to ``.pending-<part>.parquet`` (hidden
   from readers by its leading dot), fsync the file and its directory;
2. delete exactly those ids in the same transaction and commit;
3. rename the file to ``<part>.parquet`` and fsync the directory.

A pending file left by a crash is settled by the next run (:func:`recover`):
if none of its ids are in the table any more, the delete committed and the
file is published; if all of them are, it rolled back and the file is removed.
A pending file that is not a whole Parquet file (the run died while writing
it: empty, or cut short) is removed too: step 2 runs only after step 1 has
returned, so its rows were never deleted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from nmbus.errors import RetentionError
from nmbus.ports.operations import ProgressCallback, RetentionPolicy, RetentionResult
from nmbus.postgres.archive import (
    ARCHIVE_COLUMNS,
    PENDING,
    archive_schema,
    partition_dir,
    pending_ids,
    publish,
    write_pending,
)
from nmbus.postgres.claimcheck import sweep
from nmbus.postgres.reclaim import reclaim_segments, roll_ripe
from nmbus.postgres.segments import roll, segments
from nmbus.postgres.sql import render

if TYPE_CHECKING:
    import asyncpg

log = structlog.get_logger("nmbus.retention")

__all__ = [
    "ARCHIVE_COLUMNS",
    "archive_schema",
    "clean_queue",
    "partition_dir",
    "publish",
    "recover",
    "write_pending",
]


async def clean_queue(
    conn: Any,
    schema: str,
    queue: str,
    policy: RetentionPolicy,
    on_batch: ProgressCallback | None = None,
    holder: Any = None,
) -> RetentionResult:
    """Remove (and archive, if the policy says so) the old rows of one queue.

    ``conn`` must not be inside a transaction: each batch commits on its own.
    ``on_batch(queue, rows)`` is called after every committed batch. When
    another run already holds this queue, returns at once with ``skipped``.
    ``holder``: behind a transaction pooler, another connection, whose open
    transaction holds the run's lock (a session lock would stay on whichever
    server connection the pooler lent).
    """
    result = RetentionResult(queue)
    async with _one_run(conn, schema, queue, holder) as alone:
        if not alone:
            log.info("retention_skipped", queue=queue, reason="another run holds the queue")
            result.skipped = True
            return result
        await _clean(conn, schema, queue, policy, on_batch, result)
    log.info(
        "retention_done",
        queue=queue,
        deleted_processed=result.deleted["X"],
        deleted_failed=result.deleted["F"],
        segments_dropped=result.segments_dropped,
        bytes_freed=result.bytes_freed,
        rows_moved=result.rows_moved,
        segments_pinned=result.segments_pinned,
        files=len(result.files),
        batches=result.batches,
        longest_batch_seconds=round(result.longest_batch_seconds, 3),
        payloads_deleted=result.payloads_deleted,
        orphans_deleted=result.orphans_deleted,
    )
    return result


@asynccontextmanager
async def _one_run(conn: Any, schema: str, queue: str, holder: Any) -> AsyncIterator[bool]:
    """Whether this is the one run of ``queue`` now; the lock is held until the block ends."""
    key = f"nmbus.retention.{schema}.{queue}"
    if holder is not None:
        async with holder.transaction():
            row = await holder.fetchrow(render("retention_lock_held", schema), key)
            yield bool(row[1])
        return
    alone = bool(await conn.fetchval(render("retention_lock", schema), key))
    try:
        yield alone
    finally:
        if alone:
            await conn.fetchval(render("retention_unlock", schema), key)


async def _clean(
    conn: Any,
    schema: str,
    queue: str,
    policy: RetentionPolicy,
    on_batch: ProgressCallback | None,
    result: RetentionResult,
) -> None:
    if policy.archive_dir is not None:
        result.recovered_files = await recover(conn, schema, queue, policy.archive_dir)
    # I/R rows that expired long ago and no worker took would stay forever.
    while await conn.fetchval(
        render("retention_expire", schema, queue), policy.max_age, policy.batch_size
    ):
        pass
    passes: list[tuple[str, timedelta]] = []
    if await segments(conn, schema, queue):
        # Processed rows go with their segments, whole, never the one being
        # written: so that one rolls first if its rows are already past the age.
        early = await roll_ripe(conn, schema, queue, policy)
        await reclaim_segments(conn, schema, queue, policy, result, on_batch)
        # At MAX_LIVE_SEGMENTS it could not roll: the drops may have made room.
        again = early is None and result.segments_dropped > 0
        if again and await roll_ripe(conn, schema, queue, policy) is not None:
            await reclaim_segments(conn, schema, queue, policy, result, on_batch)
        # Then the next segment, once the one being written is full of time.
        await roll(conn, schema, queue, policy.segment_seconds)
    else:
        passes.append(("X", policy.max_age))
    if policy.failed_max_age is not None:
        passes.append(("F", policy.failed_max_age))
    for subqueue, age in passes:
        await _walk(conn, schema, queue, subqueue, age, policy, result, on_batch)
    # The payloads stored apart whose messages just went, or went by other means.
    result.payloads_deleted, result.orphans_deleted = await sweep(
        conn, schema, queue, policy.claim_check_store, policy.max_age
    )


async def _walk(
    conn: asyncpg.Connection,
    schema: str,
    queue: str,
    subqueue: str,
    age: timedelta,
    policy: RetentionPolicy,
    result: RetentionResult,
    on_batch: ProgressCallback | None,
) -> None:
    bounds = await conn.fetchrow(render("retention_bounds", schema, queue))
    assert bounds is not None
    low, high = bounds
    if low is None:
        return
    window = policy.batch_size * 10
    last = int(low) - 1
    while last < high:
        upper = min(last + window, int(high))
        started = time.perf_counter()
        if policy.archive_dir is None:
            row = await conn.fetchrow(
                render("retention_delete_window", schema, queue),
                [subqueue],
                age,
                last,
                upper,
                policy.batch_size,
            )
            assert row is not None
            top, count = row
        else:
            top, count = await _archive_batch(
                conn, schema, queue, subqueue, age, last, upper, policy, result
            )
        elapsed = time.perf_counter() - started
        if count:
            result.batches += 1
            result.deleted[subqueue] += count
            result.longest_batch_seconds = max(result.longest_batch_seconds, elapsed)
            if on_batch is not None:
                on_batch(queue, count)
        # A full batch may have left more rows in this window; otherwise move on,
        # over the gaps between segments (ids jump by 2^36 from one to the next).
        if count == policy.batch_size:
            last = int(top)
        else:
            following = await conn.fetchval(render("retention_next_id", schema, queue), upper)
            last = high if following is None else max(upper, int(following) - 1)


async def _archive_batch(
    conn: asyncpg.Connection,
    schema: str,
    queue: str,
    subqueue: str,
    age: timedelta,
    last: int,
    upper: int,
    policy: RetentionPolicy,
    result: RetentionResult,
) -> tuple[int | None, int]:
    assert policy.archive_dir is not None
    async with conn.transaction():
        rows = await conn.fetch(
            render("retention_pick", schema, queue), [subqueue], age, last, upper, policy.batch_size
        )
        if not rows:
            return None, 0
        ids = [r["id"] for r in rows]
        pending = await asyncio.to_thread(write_pending, policy.archive_dir, queue, rows)
        deleted = await conn.fetch(render("retention_delete", schema, queue), ids, [subqueue])
        if len(deleted) != len(ids):
            # Rolled back with the transaction; recover() removes the pending files.
            raise RetentionError(
                f"{queue}: {len(ids) - len(deleted)} of {len(ids)} locked rows changed "
                "subqueue before deletion; nothing deleted"
            )
    result.files.extend(await asyncio.to_thread(publish, pending))
    return ids[-1], len(ids)


async def recover(conn: asyncpg.Connection, schema: str, queue: str, archive_dir: Path) -> int:
    """Settle pending files a dead run left behind; returns how many were settled."""
    root = archive_dir / f"queue={queue}"
    if not root.is_dir():
        return 0
    settled = 0
    for path in sorted(root.glob(f"day=*/{PENDING}*.parquet")):
        ids = await asyncio.to_thread(pending_ids, path)
        if ids is None:
            # Rows are deleted only after their file is whole and synced, in
            # the transaction that follows write_pending: a file that never
            # became whole never had its rows deleted. They are still in the
            # table, and a later batch archives them.
            path.unlink()
            log.warning(
                "retention_recovered", queue=queue, file=str(path), outcome="discarded_incomplete"
            )
            settled += 1
            continue
        present = await conn.fetchval(render("retention_present", schema, queue), ids)
        if present == 0:
            await asyncio.to_thread(publish, [path])
            log.warning("retention_recovered", queue=queue, file=str(path), outcome="published")
        elif present == len(ids):
            path.unlink()
            log.warning("retention_recovered", queue=queue, file=str(path), outcome="discarded")
        else:
            log.error(
                "retention_pending_ambiguous",
                queue=queue,
                file=str(path),
                present=present,
                rows=len(ids),
            )
            continue
        settled += 1
    return settled
