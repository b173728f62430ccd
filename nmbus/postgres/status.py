"""How busy a queue is, read from PostgreSQL: the status, depth, window and segment reads.

Functions over a connection inside the caller's read-only transaction
(:class:`nmbus.postgres.operations.PostgresOperations` opens it). The SQL is
the ``ops_*`` blocks; X rows are never scanned on big tables (docs/dashboard.md,
"Cost").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncpg

from nmbus.ports.operations import (
    BlockedSequence,
    QueueStatus,
    ReadLimits,
    SegmentInfo,
    WindowStats,
    window_stats,
)
from nmbus.postgres.schema import CREATED_BY_SEND
from nmbus.postgres.sql import SEGMENT_SPAN, own_name, render

#: Lists the queues that have a table now (to read again without a dropped one).
Lister = Callable[[], Awaitable[list[str]]]

# Ids are bigints: a segment's probe runs from its first id to its last, both inclusive.
_FIRST_ID, _LAST_ID = -(2**63), 2**63 - 1


async def each_queue(
    conn: Any, schema: str, block: str, names: Sequence[str], queues: Lister, *args: Any
) -> list[tuple[int, Any]]:
    """Query ``block`` on every queue of ``names`` in one statement: (position, row) pairs.

    The statement is the block rendered for each queue (identifiers quoted
    by render, as always), each one under its position in ``names``, joined
    by UNION ALL; nothing else goes into its text. A table dropped since it
    was listed fails the statement, which is read again without it.
    """
    if not names:
        return []
    parts = [
        f"SELECT {k}::int AS k, b.* FROM ({render(block, schema, name).rstrip(';')}) AS b"
        for k, name in enumerate(names)
    ]
    try:
        async with conn.transaction():  # a savepoint: a missing table is not the end
            rows = await conn.fetch("\nUNION ALL\n".join(parts), *args)
    except asyncpg.UndefinedTableError:
        here = set(await queues())
        kept = [(k, n) for k, n in enumerate(names) if n in here]
        again = await each_queue(conn, schema, block, [n for _, n in kept], queues, *args)
        return [(kept[k][0], row) for k, row in again]
    return [(int(r["k"]), r) for r in rows]


async def created_by_send(
    conn: Any, schema: str, names: Sequence[str], queues: Lister
) -> dict[str, str | None]:
    """Which of ``names`` carry the mark of a queue a send created, with their first sender."""
    sql = render("ops_marked_queues", schema)
    marks = {r["name"] for r in await conn.fetch(sql, schema, CREATED_BY_SEND)}
    marked = [n for n in names if n in marks]
    found: dict[str, str | None] = dict.fromkeys(marked)
    for k, row in await each_queue(conn, schema, "ops_first_sender", marked, queues):
        found[marked[k]] = row["sender"]
    return found


async def status_of(
    conn: Any,
    schema: str,
    name: str,
    windows: Sequence[float],
    exact: bool,
    limits: ReadLimits,
) -> QueueStatus:
    heads = await conn.fetch(render("ops_blocked_sequences", schema, name), limits.blocked_shown)
    blocked = tuple(BlockedSequence(**dict(h)) for h in heads)
    stats = tuple([await window(conn, schema, name, w, limits.window_rows) for w in windows])
    sagas, sagas_estimated = await saga_count(conn, schema, name, limits.exact_count_pages)
    if exact:
        row = dict(await conn.fetchrow(render("ops_queue_status", schema, name), windows[0]))
        estimated = False
    else:
        counts = dict(await conn.fetchrow(render("ops_queue_counts", schema, name), schema, name))
        live, pages = (int(v) for v in counts.pop("tree"))
        if pages <= limits.exact_count_pages:
            processed = int(await conn.fetchval(render("ops_count_processed", schema, name)))
            estimated = False
        else:
            open_rows = counts["ready"] + counts["scheduled"] + counts["failed"]
            processed, estimated = max(live - open_rows, 0), True
        recent = stats[0]
        row = {
            **counts,
            "processed": processed,
            "recent_processed": recent.processed,
            "recent_avg_ms": recent.avg_ms,
            "recent_p99_ms": recent.p99_ms,
            "recent_failed": recent.failed,
        }
    return QueueStatus(
        name,
        **row,
        blocked=blocked,
        processed_estimated=estimated,
        windows=stats,
        sagas=sagas,
        sagas_estimated=sagas_estimated,
    )


async def window(conn: Any, schema: str, name: str, seconds: float, cap: int) -> WindowStats:
    row = await conn.fetchrow(render("ops_window", schema, name), seconds, cap)
    latencies = (row["avg_ms"], row["p50_ms"], row["p95_ms"], row["p99_ms"])
    processed, failed = int(row["processed"]), int(row["failed"])
    return window_stats(seconds, cap, processed, failed, row["since"], row["now"], latencies)


async def saga_count(
    conn: Any, schema: str, name: str, exact_pages: int
) -> tuple[int | None, bool]:
    saga_table = own_name(name, "saga")
    row = await conn.fetchrow(render("ops_table_rows", schema), schema, saga_table)
    if row is None:
        return None, False
    live, pages = row
    if pages is not None and pages <= exact_pages:
        return int(await conn.fetchval(render("ops_saga_count", schema, name))), False
    return int(live or 0), True


async def segments_of(conn: Any, schema: str, names: Sequence[str]) -> list[SegmentInfo]:
    """The segments of the queues ``names``: one read of the catalogue for all of them, then
    one statement per queue (ops_segment_probe) for what only its rows can say."""
    listed = await conn.fetch(render("ops_queue_segments", schema), schema, list(names))
    by_queue: dict[str, list[Any]] = {}
    for row in listed:
        by_queue.setdefault(row["queue"], []).append(row)
    found: list[SegmentInfo] = []
    for name in names:
        rows = by_queue.get(name, [])
        if not rows:
            continue  # dropped since it was listed, or partitioned with no segment yet
        firsts, lasts = zip(*(_id_range(r) for r in rows), strict=True)
        sql = render("ops_segment_probe", schema, name)
        try:
            async with conn.transaction():  # a savepoint: a queue dropped meanwhile is skipped
                probes = await conn.fetch(sql, [r["oid"] for r in rows], firsts, lasts)
        except asyncpg.UndefinedTableError:
            continue
        segments = [
            SegmentInfo(
                name,
                row["name"],
                _number(name, row["name"], row["low_id"]),
                int(row["rows"]),
                int(probe["pending"]),
                probe["oldest"],
                probe["newest"],
                int(row["size_bytes"]),
            )
            for row, probe in zip(rows, probes, strict=True)
        ]
        found.extend(sorted(segments, key=lambda s: (s.number, s.name)))
    return found


def _id_range(row: Any) -> tuple[int, int]:
    """The first and last id segment ``row`` may hold (an empty range: not a range partition)."""
    if not row["ranged"]:
        return 0, -1
    low, high = row["low_id"], row["high_id"]
    return (_FIRST_ID if low is None else low), (_LAST_ID if high is None else high - 1)


def _number(queue: str, table: str, low_id: int | None) -> int:
    """n of a segment: from its name ``<queue>$s<n>``, else from its first id (2^36 a segment)."""
    suffix = table.removeprefix(f"{queue}$s")
    if suffix != table and suffix.isascii() and suffix.isdigit():
        return int(suffix)
    return 0 if low_id is None else max(low_id, 0) // SEGMENT_SPAN
