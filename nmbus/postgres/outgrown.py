"""Planner statistics a burst has outgrown, renewed by the workers that drain it.

A worker plans its statements once per connection (nmbus/postgres/store.py),
most often while its queue is quiet, and PostgreSQL plans them again whenever
a table they read is analyzed. A queue analyzed at rest (nearly all its rows in
X) tells the planner that a claim finds a row or two; for that, reading every
ready row and sorting them costs no more than reading the ready index in order,
and that is the plan kept. When a burst arrives, each claim then sorts the
whole backlog to take one batch of it (docs/performance.md, "A burst into a
quiet queue"), until autovacuum, whose turn may be a minute away, analyzes the
segment again.

So a claim that comes back with at least :data:`FULL_CLAIM` rows marks the
segments its rows came from (:class:`nmbus.postgres.floor.ReadyFloors`), and
the loops' background read of the ready floor, about once a second while they
claim, analyzes those of them whose statistics say they hold fewer than
:data:`THOUGHT_READY` ready rows: what autovacuum would do, without waiting for
its turn. Analyzed with the burst in it, a segment's statistics count its
ready rows, so the drain that follows triggers no other analyze; and a
process analyzes a segment at most once in :data:`AGAIN_SECONDS` (should a
sample of a huge segment miss its few ready rows, say). The
analyze runs on a pooled connection, in one process at a time (an advisory
lock), and gives up on a lock it cannot take within :data:`LOCK_TIMEOUT`. A
segment this role does not own is left to autovacuum.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import asyncpg
import structlog

from nmbus.messages import StoredMessage
from nmbus.postgres.segments import bound_lock_wait, queue_regclass, segment_of
from nmbus.postgres.sql import render, render_segment

log = structlog.get_logger("nmbus.worker")

#: Rows a claim must take to mark the segments they came from.
FULL_CLAIM = 200
#: A marked segment whose statistics say fewer ready rows than this is analyzed.
THOUGHT_READY = 1_000
#: A process analyzes a segment at most once in this many seconds.
AGAIN_SECONDS = 60.0
#: The longest an analyze waits for a lock (a roll, a drop, another analyze).
LOCK_TIMEOUT = "100ms"


def claimed_from(messages: Sequence[StoredMessage]) -> set[int]:
    """The segments a claim of ``messages`` took them from, if it took a full batch.

    The segments of its first and last message, and those between: a claim's
    messages come in ready order, which is id order but for priorities and
    retries (a segment missed here is marked by a later claim).
    """
    if len(messages) < FULL_CLAIM:
        return set()
    first, last = sorted((segment_of(messages[0].id), segment_of(messages[-1].id)))
    return set(range(first, last + 1))


async def analyze_outgrown(
    conn: Any, schema: str, queue: str, segments: Iterable[int]
) -> list[int]:
    """Analyze those of ``segments`` of ``queue`` whose statistics a burst has outgrown.

    Returns the numbers of the segments analyzed. A segment another process is
    analyzing, or whose lock is not free at once, is skipped.
    """
    marked = sorted(set(segments))
    if not marked:
        return []
    analyzed: list[int] = []
    for number in await _outgrown(conn, schema, queue, marked):
        try:
            async with conn.transaction():
                key = f"nmbus.analyze.{schema}.{queue}.{number}"
                if not await conn.fetchval(render("try_advisory_lock", schema), key):
                    continue
                # Another process may have analyzed it since the look above.
                if not await _outgrown(conn, schema, queue, [number]):
                    continue
                await bound_lock_wait(conn, schema, LOCK_TIMEOUT)
                await conn.execute(render_segment("analyze_segment", schema, queue, number))
        except (asyncpg.LockNotAvailableError, asyncpg.UndefinedTableError):
            continue  # busy, or dropped meanwhile: the next full claim marks it again
        analyzed.append(number)
    if analyzed:
        log.debug("segments_analyzed", queue=queue, segments=analyzed)
    return analyzed


async def _outgrown(conn: Any, schema: str, queue: str, segments: list[int]) -> list[int]:
    rows = await conn.fetch(
        render("outgrown_segments", schema),
        queue_regclass(schema, queue),
        segments,
        THOUGHT_READY,
    )
    return [int(r["number"]) for r in rows]
