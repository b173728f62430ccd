"""The ready floor: an id below which a queue holds no row a worker may claim or wait on.

A queue table's segments all take part in a statement on the queue table, and
PostgreSQL cannot leave any out of a generic plan by itself: the claim's ready
scan opens every segment's ready index, a sequence's head is looked for in
every segment's sequence index, and ``id = ANY($1)`` looks up every id of a
batch in every segment's primary key. Retention keeps up to 16 segments, most
of them holding only processed rows, so each segment would add its cost to
every batch.

The worker's statements therefore name the ids they may touch. The floor is
the lowest id of the lowest segment that holds a row of the ready index (I or
R, leased or not) or a member of a sequence not in X; when none does, of the
segment being written. Every claim, finish and sequence probe of the worker
says ``id >= floor``, and PostgreSQL leaves the segments below it out when the
statement starts (run-time pruning on a parameter). A finish without a claim,
a lease renewal or an isolation bounds its ids by the lowest of them instead.

The floor is read again every :data:`REFRESH_SECONDS`, off the loops' path: a
claim that finds it stale goes on with the floor it has while one task reads
it again on a pooled connection (a floor read on the loop's own connection
would add its round trip to one message a second, which is the p99 of a queue
at a few hundred messages a second). Only the first read of a queue is made
inline. Rows sent, retried or moved by retention go to the segment being
written or stay where they are counted, never below the floor. A row comes
back below it only by hand, when an operator requeues an F or X row of an
older segment; it then waits about :data:`REFRESH_SECONDS` before a claim
sees it. Each read in the background also analyzes the segments full claims
took rows from, where their planner statistics say they hold almost no ready
rows: a burst has outgrown them (nmbus/postgres/outgrown.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import structlog

from nmbus.messages import StoredMessage
from nmbus.postgres.outgrown import AGAIN_SECONDS, analyze_outgrown, claimed_from
from nmbus.postgres.segments import LOWEST_ID, Segment, segment_of
from nmbus.postgres.sql import SEGMENT_SPAN, quote_ident, render

log = structlog.get_logger("nmbus.worker")

#: How long a worker trusts a queue's ready floor before reading it again.
REFRESH_SECONDS = 1.0

#: The lowest bigint: the floor of a queue before it is read (every segment).
NO_FLOOR = LOWEST_ID


async def read_floor(conn: Any, schema: str, queue: str) -> int:
    """The lowest id of the lowest segment of ``queue`` that holds a ready row.

    When none does, the lowest id of the segment being written. A table that is
    not segmented has no floor (:data:`NO_FLOOR`), nor has segment 0 (it begins
    at the lowest bigint).
    """
    return (await read_floor_and_groups(conn, schema, queue))[0]


async def read_floor_and_groups(conn: Any, schema: str, queue: str) -> tuple[int, bool]:
    """:func:`read_floor`, and whether any ready row of ``queue`` carries a group."""
    row = await conn.fetchrow(
        render("ready_floor", schema, queue),
        f"{quote_ident(schema)}.{quote_ident(queue)}",
        SEGMENT_SPAN,
    )
    if row is None or not row["segments"]:
        return NO_FLOOR, False
    ready = row["ready"]
    number = int(ready) if ready is not None else segment_of(row["next_id"])
    return Segment(number, "").lower, bool(row["grouped"])


class ReadyFloors:
    """The ready floor of each queue, shared by a store's worker loops, read when stale.

    Read with it: whether the queue's ready rows carry groups, which makes its
    workers claim the groups in turn (claim_fair).
    """

    def __init__(
        self,
        schema: str,
        refresh: float = REFRESH_SECONDS,
        connection: Callable[[], AbstractAsyncContextManager[Any]] | None = None,
    ) -> None:
        self._schema = schema
        self._refresh = refresh
        self._floors: dict[str, tuple[int, bool, float]] = {}
        # Where a stale floor is read again in the background (a pool's acquire);
        # None: on the caller's connection, as the first read always is.
        self._connection = connection
        self._reading: dict[str, asyncio.Task[None]] = {}
        # Per queue, the segments full claims took rows from since the last look.
        self._full: dict[str, set[int]] = {}
        # When this process may analyze each (queue, segment) again.
        self._analyzed: dict[tuple[str, int], float] = {}

    def cached(self, queue: str) -> int:
        """The floor last read (NO_FLOOR before the first read), without a query."""
        found = self._floors.get(queue)
        return NO_FLOOR if found is None else found[0]

    def grouped(self, queue: str) -> bool:
        """Whether ready rows carried groups when the floor was last read."""
        found = self._floors.get(queue)
        return found is not None and found[1]

    def stale(self, queue: str) -> bool:
        found = self._floors.get(queue)
        return found is None or time.monotonic() - found[2] >= self._refresh

    async def floor(self, conn: Any, queue: str) -> int:
        """The floor of ``queue``, read on ``conn`` when it is stale.

        ``conn`` may be inside a transaction: the query only reads the catalog
        and the queue table through its parent, so it cannot fail for a segment
        dropped meanwhile.
        """
        found = self._floors.get(queue)
        if found is not None and time.monotonic() - found[2] < self._refresh:
            return found[0]
        if found is None or self._connection is None:
            value, grouped = await read_floor_and_groups(conn, self._schema, queue)
            self._floors[queue] = (value, grouped, time.monotonic())
            return value
        if queue not in self._reading:
            task = asyncio.get_running_loop().create_task(self._read_again(queue))
            self._reading[queue] = task
        return found[0]

    async def _read_again(self, queue: str) -> None:
        assert self._connection is not None
        try:
            async with self._connection() as conn:
                value, grouped = await read_floor_and_groups(conn, self._schema, queue)
                self._floors[queue] = (value, grouped, time.monotonic())
                await self._renew_statistics(conn, queue)
        except Exception as exc:  # the loops' own statements will say what is wrong
            log.warning("ready_floor_not_read", queue=queue, error=str(exc))
            found = self._floors.get(queue)
            if found is not None:  # try again after another interval
                self._floors[queue] = (found[0], found[1], time.monotonic())
        finally:
            self._reading.pop(queue, None)

    def claimed(self, queue: str, messages: Sequence[StoredMessage]) -> None:
        """Note a claim's rows: a full batch marks the segments they came from."""
        segments = claimed_from(messages)
        if segments:
            self._full.setdefault(queue, set()).update(segments)

    async def _renew_statistics(self, conn: Any, queue: str) -> None:
        """Analyze the marked segments a burst has outgrown (nmbus/postgres/outgrown.py)."""
        marked = self._full.pop(queue, None)
        now = time.monotonic()
        if marked:
            marked = {n for n in marked if now >= self._analyzed.get((queue, n), now)}
        if not marked:
            return
        try:
            for number in await analyze_outgrown(conn, self._schema, queue, marked):
                self._analyzed[(queue, number)] = now + AGAIN_SECONDS
        except Exception as exc:  # autovacuum still comes; the floor was read
            # Not tried again for a while (a statement_timeout shorter than an
            # analyze would otherwise fail, and say so, every second).
            for number in marked:
                self._analyzed[(queue, number)] = now + AGAIN_SECONDS
            log.warning("statistics_not_renewed", queue=queue, error=str(exc))

    def forget(self, queue: str) -> None:
        """Read the floor of ``queue`` again before its next use."""
        self._floors.pop(queue, None)
