"""Flow control on PostgreSQL: the claim of an endpoint whose handlers declare limits.

The claim runs in a transaction of its own on the loop's connection: it takes
the queue's flow lock (an advisory lock held until the transaction ends), so
the flights it counts include every limited claim committed before, then
claims with ``flow_claim`` (nmbus/postgres/sql/flow.sql) and commits, which
releases the lock. Three round trips instead of one, for endpoints with limits
only; an endpoint without limits never runs any of this.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from typing import Any

import asyncpg

from nmbus.delivery.flow import FlowLimits, LimitStatus
from nmbus.postgres.sql import render

#: How many batches of ready rows a limited claim looks at, at most: rows held
#: back by a group's limit are passed over within them.
POOL_BATCHES = 4
#: Flights that no longer run are kept at least this long (for the rate windows).
FORGET_AFTER = 10.0
#: How soon a loop whose claim held messages back claims again, at the latest
#: (a concurrency limit's room comes back when a message ends, which no one
#: announces), and at the soonest.
RECHECK, MIN_RECHECK = 0.1, 0.002


def flow_lock_key(schema: str, queue: str) -> int:
    """The advisory lock of ``queue``'s limited claims: a signed 64-bit number."""
    digest = hashlib.blake2b(f"nmbus.flow.{schema}.{queue}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


async def claim_limited(
    conn: Any,
    schema: str,
    queue: str,
    flow: FlowLimits,
    limit: int,
    claim: str,
    lease: float,
    floor: int,
) -> list[Any]:
    """Claim up to ``limit`` rows of ``queue`` within the limits of ``flow``; the rows.

    A claim takes at most ``flow.at_once`` messages of a concurrency-limited
    handler: as many as the claiming loop runs at once.
    """
    labels, label_keys = flow.label_pairs()
    keys, concurrency, starts, windows, group_concurrency = flow.arrays()
    # Read committed whatever the server's default: the claim must take its snapshot
    # after the lock, so that it sees the flights of the claim that held it before.
    async with conn.transaction(isolation="read_committed"):
        await conn.execute(render("flow_lock", schema), flow_lock_key(schema, queue))
        rows: list[Any] = await conn.fetch(
            render("flow_claim", schema, queue),
            limit,
            claim,
            lease,
            floor,
            queue,
            labels,
            label_keys,
            keys,
            concurrency,
            starts,
            windows,
            group_concurrency,
            limit * POOL_BATCHES,
            max(FORGET_AFTER, flow.longest_window),
            flow.at_once,
        )
    return rows


async def held_back(
    conn: Any, schema: str, queue: str, flow: FlowLimits, floor: int
) -> float | None:
    """When to claim again after a claim that held limited messages back, in seconds;
    None when none waits. A full rate window has room again when its oldest start
    leaves it; a concurrency limit when a message ends, which only a poll sees."""
    labels = sorted({label for names in flow.labels.values() for label in names})
    keys, _, starts, windows, _ = flow.arrays()
    rated = [(k, w) for k, s, w in zip(keys, starts, windows, strict=True) if s is not None]
    row = await conn.fetchrow(
        render("flow_waiting", schema, queue),
        labels,
        floor,
        queue,
        [k for k, _ in rated],
        [w for _, w in rated],
    )
    if row is None or not row["waiting"]:
        return None
    soonest = row["next_room"]
    if soonest is None:
        return RECHECK
    return min(RECHECK, max(MIN_RECHECK, float(soonest)))


async def flow_status_on(
    conn: Any, schema: str, queues: Collection[str] | None
) -> list[LimitStatus]:
    """Each limited handler of ``queues`` (None: every queue), by queue then handler."""
    found: list[LimitStatus] = []
    for row in await conn.fetch(render("flow_limited_queues", schema)):
        if queues is None or row[0] in queues:
            found += await limits_of(conn, schema, row[0])
    return found


async def limits_of(conn: Any, schema: str, queue: str) -> list[LimitStatus]:
    """Each limited handler of ``queue`` as last declared, and what it holds back now.

    [] when the queue has no limits declared, or its table is gone; read-only.
    """
    try:
        async with conn.transaction():  # a savepoint: a queue dropped meanwhile has none
            rows = await conn.fetch(render("flow_status", schema, queue), queue)
    except asyncpg.UndefinedTableError:
        return []
    return [
        LimitStatus(
            queue,
            r["key"],
            r["limits"],
            r["declared_by"],
            r["declared_at"],
            int(r["in_flight"]),
            None if r["started"] is None else int(r["started"]),
            int(r["waiting"]),
            int(r["held_back"]),
        )
        for r in rows
    ]
