"""Held batches (setting ``held_batches``): a batch's transaction holds its rows.

A leased claim writes every row twice: the claim leases it (counting the
attempt), the finish records its outcome. A held batch writes each row once.
Its claim (``claim_held``) only locks the rows, in the batch's own transaction;
before the handlers run, a record of which rows it holds is committed on a
second connection (``held_record``); the finish counts the attempt, records the
outcome and drops the record in one statement, and the commit lets go of the
locks. The record is what a crash leaves: it names ``holder``, an advisory
lock that the loop's connection holds while it lives, and claims leave the
rows of every record alone until ``recover_held`` finds its holder gone and
turns the record into what a lease that ran out leaves (the attempt counted,
the rows recovered as suspects). A held batch that does not end in its finish
(a part commit, a rollback, a stop) is leased on the spot (``lease_held``) and
goes on as a leased batch: everything after that is the leased path's.

See docs/reliability.md, "Held batches".
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import asyncpg
from asyncpg.transaction import Transaction

from nmbus.errors import DatabaseUnavailable
from nmbus.postgres.sql import render

T = TypeVar("T")

#: Holder keys are drawn at or above this (the hashtext keys of other advisory
#: locks are 32-bit) and below 2**62.
HOLDER_BASE = 2**32
#: The savepoint a held batch's claim sets: a batch that fails rolls back to it,
#: keeping the claim's row locks until the lease that follows commits.
HELD_SAVEPOINT_NAME = "nmbus_held"
HELD_SAVEPOINT = f"SAVEPOINT {HELD_SAVEPOINT_NAME}"
#: Claims of one held batch in a row that may meet a record naming one of their
#: rows (held_record) before the loop claims leased instead.
OVERLAP_TRIES = 3


class Holder:
    """A loop's advisory lock that says it lives, and the second connection that
    commits its batches' records."""

    def __init__(self, conn: asyncpg.Connection, side: asyncpg.Connection, key: int) -> None:
        self.conn = conn
        self.side = side
        self.key = key

    @classmethod
    async def take(cls, conn: asyncpg.Connection, side: asyncpg.Connection, schema: str) -> Holder:
        """Take a free holder lock on ``conn`` (held until it closes)."""
        sql = render("take_holder", schema)
        while True:
            key = HOLDER_BASE + secrets.randbelow(2**62 - HOLDER_BASE)
            if await conn.fetchval(sql, key):
                return cls(conn, side, key)

    async def record(
        self, schema: str, queue: str, batch: int, client_id: str, ids: Sequence[int]
    ) -> bool:
        """Commit the record of held batch ``batch``; False when a record names one of its rows."""
        sql = render("held_record", schema, queue)
        return bool(await self.side.fetchval(sql, batch, self.key, client_id, list(ids)))


@dataclass
class HeldBatch:
    """A held batch between its claim and its finish: its transaction (open on the
    loop's connection), its record's number, its rows, and the lease it takes
    if it must go on leased."""

    transaction: Transaction
    number: int
    ids: list[int]
    queue: str
    client_id: str
    lease: float


def new_batch_key() -> int:
    """A held batch's number: random, so no sequence is shared by the loops."""
    return secrets.randbits(63)


async def lease_held(
    conn: asyncpg.Connection,
    schema: str,
    queue: str,
    batch: int,
    ids: Sequence[int],
    client_id: str,
    lease: float,
) -> int:
    """Lease rows ``ids`` of held batch ``batch`` to ``client_id`` and drop its record."""
    sql = render("lease_held", schema, queue)
    return int(await conn.fetchval(sql, list(ids), batch, client_id, lease))


async def recover_held(conn: asyncpg.Connection, schema: str, queue: str, own: int) -> int:
    """Turn the records of dead holders into expired leases; how many rows."""
    return int(await conn.fetchval(render("recover_held", schema, queue), own))


async def stopped_with(conn: asyncpg.Connection, work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` (a held batch), cancelled as soon as ``conn`` ends under it.

    A held batch's rows are kept by this backend: ended under it (an operator's
    pg_terminate_backend, a failover), its locks and its holder lock go, and any
    worker recovers the batch at its next poll. Its handlers are stopped as a
    crash would stop them, rather than running on beside that recovery; the
    loop then connects again (DatabaseUnavailable).
    """
    if conn.is_closed():
        # Ended before the batch began (while it waited at the process gate for a
        # suspect running alone, say): a listener added now would never be called.
        work.close()
        raise DatabaseUnavailable(
            "the worker's connection ended under a held batch before its handlers ran: "
            "its messages go to another worker as after a crash"
        )
    task = asyncio.ensure_future(work)
    lost = False

    def ended(_: object) -> None:
        nonlocal lost
        if not task.done():
            lost = True
            task.cancel()

    conn.add_termination_listener(ended)
    try:
        return await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if lost and (current is None or not current.cancelling()):
            raise DatabaseUnavailable(
                "the worker's connection ended under a held batch: its handlers were "
                "stopped, and its messages go to another worker as after a crash"
            ) from None
        raise
    finally:
        conn.remove_termination_listener(ended)
