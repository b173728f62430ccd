"""A worker loop's connection on PostgreSQL: its claims and its batches' transactions.

:class:`PostgresSession` is the loop's own connection (claim, next due,
isolate); :class:`PostgresBatch` is one claimed batch's transaction on it,
begun lazily (see its docstring), which records outcomes with the
finish-and-claim statement and takes the sends and publishes of its handlers.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import asyncpg
import structlog
from asyncpg.transaction import Transaction

from nmbus.delivery.flow import FlowLimits
from nmbus.messages import Envelope, StoredMessage
from nmbus.ports.store import Outcomes
from nmbus.postgres.claimcheck import (
    ClaimCheck,
    carries_reference,
    has_apart,
    insert_apart,
    resolve,
)
from nmbus.postgres.errors import wrap_errors
from nmbus.postgres.floor import ReadyFloors
from nmbus.postgres.flow import claim_limited, held_back
from nmbus.postgres.listen import notify_channel
from nmbus.postgres.pubsub import publish_args, publish_on
from nmbus.postgres.rows import claimed, envelope_arrays, insert_args, insert_sql
from nmbus.postgres.schema import ensure_queue_on
from nmbus.postgres.sql import render

log = structlog.get_logger("nmbus.worker")

#: The largest value PostgreSQL takes for a timeout in milliseconds (INT_MAX).
MAX_TIMEOUT_MS = 2_147_483_647


async def insert_outbox(
    conn: Any, schema: str, queue: str, from_endpoint: str, envelopes: Sequence[Envelope]
) -> int:
    """Write messages for ``queue`` (in another database) into the outbox, on ``conn``.

    One statement: atomic on its own, or part of the caller's transaction.
    """
    args = insert_args(
        from_endpoint, queue, envelope_arrays(envelopes), notify_channel(schema, outbox=True)
    )
    with wrap_errors(f"send to {queue} (through the outbox)"):
        row = await conn.fetchrow(render("outbox_insert", schema), *args)
    return int(row[0]) if row else 0


class PostgresBatch:
    """One batch on a worker's connection; its transaction begins when first needed.

    A batch whose handlers never touch the connection nor send anything needs
    no transaction: its ``finish`` is one autocommitted statement, which saves
    the BEGIN and COMMIT round trips. The first write (a handler's savepoint,
    an insert) begins the transaction, and ``finish`` then runs inside it.
    """

    def __init__(
        self,
        conn: asyncpg.Connection,
        schema: str,
        known: set[str],
        routed: frozenset[str] = frozenset(),
        floors: ReadyFloors | None = None,
        flow: FlowLimits | None = None,
        lift: str | None = None,
        claim_check: ClaimCheck | None = None,
    ) -> None:
        self._conn = conn
        self._schema = schema
        self._known = known
        self._routed = routed
        self._floors = floors or ReadyFloors(schema)
        self._flow = flow
        self._claim_check = claim_check or ClaimCheck()
        self._channel = notify_channel(schema)
        # asyncpg's own Transaction, so a handler may still nest conn.transaction().
        self.transaction: Transaction | None = None
        self._unreleased = False
        # "SET LOCAL idle_in_transaction_session_timeout = ..." when the server's is
        # shorter than the batch's handlers may keep its transaction idle, else None.
        self._lift = lift

    @property
    def begun(self) -> bool:
        return self.transaction is not None

    @property
    def connection(self) -> asyncpg.Connection:
        return self._conn

    async def begin(self) -> None:
        """Begin the batch's transaction if it has not begun (no savepoint)."""
        if self.transaction is None:
            await self._start()
            if self._lift is not None:
                await self._conn.execute(self._lift)

    async def _start(self) -> None:
        transaction = self._conn.transaction()
        await transaction.start()
        self.transaction = transaction

    async def savepoint(self) -> None:
        if self._unreleased:
            # The previous handler's savepoint goes in the same round trip.
            self._unreleased = False
            await self._conn.execute("RELEASE SAVEPOINT nmbus_handler; SAVEPOINT nmbus_handler")
            return
        if self.transaction is None:
            await self._start()
            if self._lift is not None:
                # The lift goes in the savepoint's round trip.
                await self._conn.execute(f"{self._lift}; SAVEPOINT nmbus_handler")
                return
        await self._conn.execute("SAVEPOINT nmbus_handler")

    async def release_savepoint(self) -> None:
        await self._conn.execute("RELEASE SAVEPOINT nmbus_handler")

    def defer_release(self) -> None:
        """Leave a succeeded handler's savepoint to the next savepoint or the COMMIT.

        Only for a savepoint whose statements all succeeded: one that may be
        aborted must be released at once, so its handler is the one that fails.
        """
        self._unreleased = True

    async def rollback_savepoint(self) -> None:
        self._unreleased = False
        await self._conn.execute(
            "ROLLBACK TO SAVEPOINT nmbus_handler; RELEASE SAVEPOINT nmbus_handler"
        )

    async def commit(self) -> None:
        """Commit the transaction so far; the next write begins another one."""
        transaction, self.transaction = self.transaction, None
        self._unreleased = False  # COMMIT releases every savepoint
        if transaction is not None:
            await transaction.commit()

    async def insert(self, queue: str, from_endpoint: str, envelopes: Sequence[Envelope]) -> int:
        await self.begin()
        if queue in self._routed:
            # The outbox carries whole rows: a body over claim_check_bytes here is a
            # failure port's copy (a handler's send of one is refused when it is
            # built), and goes whole, as the original arrived at its handler.
            envelopes = [replace(e, apart=False) if e.apart else e for e in envelopes]
            return await insert_outbox(self._conn, self._schema, queue, from_endpoint, envelopes)
        # A handler's send is stored at its batch's commit, where a refusal would
        # fail the batch-mates too: a missing queue is created (marked, logged).
        await ensure_queue_on(self._conn, self._schema, queue, self._known, from_endpoint)
        if has_apart(envelopes):
            return await insert_apart(
                self._conn,
                self._claim_check,
                self._schema,
                queue,
                from_endpoint,
                envelopes,
                self._channel,
            )
        sql = insert_sql(self._schema, queue, len(envelopes))
        row = await self._conn.fetchrow(
            sql, *insert_args(from_endpoint, queue, envelope_arrays(envelopes), self._channel)
        )
        return int(row[0]) if row else 0

    async def subscribers(self, publisher: str, types: Sequence[str]) -> list[str]:
        rows = await self._conn.fetch(render("subscribers", self._schema), publisher, list(types))
        return [r[0] for r in rows]

    async def publish(
        self, publisher: str, envelopes: Sequence[Envelope], chains: Sequence[str]
    ) -> dict[str, int]:
        await self.begin()  # the copies commit with the batch, never before it
        args = publish_args(self._schema, publisher, envelopes, chains, self._channel, self._routed)
        return await publish_on(self._conn, self._schema, args)

    async def finish(self, queue: str, outcomes: Outcomes, claim: str) -> int:
        if self._flow is not None and self._flow.rated_keys:
            # A start whose mark is still on its way (nmbus/consume/dispatch/marks.py) is
            # marked before its lease ends, so that it counts without a gap.
            await self._conn.execute(
                render("flow_finishing", self._schema),
                queue,
                claim,
                self._flow.rated_keys,
                outcomes.ids,
            )
        if outcomes.all_processed:
            sql = render("finish_processed", self._schema, queue)
            return int(await self._conn.fetchval(sql, outcomes.ids, claim))
        return int(
            await self._conn.fetchval(
                render("finish", self._schema, queue),
                outcomes.ids,
                outcomes.subqueue,
                outcomes.delay,
                outcomes.error_info,
                outcomes.correction,
                claim,
            )
        )

    async def finish_and_claim(
        self, queue: str, outcomes: Outcomes, claim: str, limit: int, lease: float, next_claim: str
    ) -> tuple[int, list[StoredMessage]]:
        """``finish`` (rows of ``claim``), then claim up to ``limit`` more rows as
        ``next_claim``, in one statement.

        With flow limits, only ``finish``: the next claim needs a transaction
        of its own (nmbus/postgres/flow.py), which the loop's next claim runs;
        the same when the queue's ready rows carry groups (claim_fair).
        """
        if self._flow is not None or self._floors.grouped(queue):
            return await self.finish(queue, outcomes, claim), []
        floor = await self._floors.floor(self._conn, queue)
        if outcomes.all_processed:
            # The common case needs no per-row outcome arrays on the wire or in a join.
            rows = await self._conn.fetch(
                render("finish_claim_processed", self._schema, queue),
                outcomes.ids,
                claim,
                limit,
                lease,
                floor,
                next_claim,
            )
        else:
            rows = await self._conn.fetch(
                render("finish_claim", self._schema, queue),
                outcomes.ids,
                outcomes.subqueue,
                outcomes.delay,
                outcomes.error_info,
                outcomes.correction,
                claim,
                limit,
                lease,
                floor,
                next_claim,
            )
        finished = int(rows[0]["finished"]) if rows else 0
        messages = claimed(rows)
        self._floors.claimed(queue, messages)
        if carries_reference(messages):
            with wrap_errors(f"read the bodies stored apart of {queue}"):
                await resolve(self._conn, self._schema, queue, messages)
        return finished, messages


async def idle_lift(conn: asyncpg.Connection, schema: str, idle: float | None) -> str | None:
    """What each batch's transaction on ``conn`` runs to stay idle up to ``idle`` seconds.

    None when the session's ``idle_in_transaction_session_timeout`` (the server's,
    the database's or the role's) is off or already as long: nothing to lift, no
    statement. Otherwise a ``SET LOCAL`` of ``idle`` (the longest its handlers may
    keep a batch's transaction idle: their timeouts), which holds for that one
    transaction only, so it needs no session state (a transaction pooler keeps none).
    """
    if idle is None:
        return None
    with wrap_errors("read idle_in_transaction_session_timeout"):
        server = int(await conn.fetchval(render("idle_limit", schema)))
    # The setting's own ceiling (about 24.8 days), whatever the handlers' timeouts.
    wanted = min(math.ceil(idle * 1000), MAX_TIMEOUT_MS)
    if server == 0 or server >= wanted:
        return None
    return f"SET LOCAL idle_in_transaction_session_timeout = {wanted}"


class PostgresSession:
    """A worker loop's dedicated connection."""

    def __init__(
        self,
        conn: asyncpg.Connection,
        schema: str,
        known: set[str],
        routed: frozenset[str] = frozenset(),
        floors: ReadyFloors | None = None,
        flow: FlowLimits | None = None,
        lift: str | None = None,
        claim_check: ClaimCheck | None = None,
    ) -> None:
        self._conn = conn
        self._schema = schema
        self._known = known
        self._routed = routed
        self._floors = floors or ReadyFloors(schema)
        self._flow = flow
        self._lift = lift
        self._claim_check = claim_check or ClaimCheck()
        #: Seconds after which to claim again though nothing woke the loop: set when
        #: the last claim held limited messages back (nmbus/delivery/flow.py), else None.
        self.recheck: float | None = None
        #: Per queue, the last group this loop's fair claims walked to.
        self._walked: dict[str, str] = {}

    async def claim(self, queue: str, limit: int, claim: str, lease: float) -> list[StoredMessage]:
        with wrap_errors(f"claim from {queue}"):
            floor = await self._floors.floor(self._conn, queue)
            if self._flow is not None:
                rows = await claim_limited(
                    self._conn, self._schema, queue, self._flow, limit, claim, lease, floor
                )
                self.recheck = None
                if len(rows) < limit:
                    self.recheck = await held_back(
                        self._conn, self._schema, queue, self._flow, floor
                    )
            elif self._floors.grouped(queue):
                rows = await self._claim_fair(queue, limit, claim, lease, floor)
            else:
                rows = await self._conn.fetch(
                    render("claim", self._schema, queue), limit, claim, lease, floor
                )
        messages = claimed(rows)
        self._floors.claimed(queue, messages)
        if carries_reference(messages):
            with wrap_errors(f"read the bodies stored apart of {queue}"):
                await resolve(self._conn, self._schema, queue, messages)
        return messages

    async def _claim_fair(
        self, queue: str, limit: int, claim: str, lease: float, floor: int
    ) -> list[Any]:
        """claim_fair from where this loop's walk of the groups stopped."""
        rows: list[Any] = await self._conn.fetch(
            render("claim_fair", self._schema, queue),
            limit,
            claim,
            lease,
            floor,
            self._walked.get(queue, ""),
        )
        # Rows: go on after the last group walked; none, or the end reached: start over.
        self._walked[queue] = (rows[0]["walked"] or "") if rows else ""
        return rows

    async def next_due(self, queue: str) -> float | None:
        with wrap_errors(f"next due in {queue}"):
            value: float | None = await self._conn.fetchval(render("next_due", self._schema, queue))
            return value

    async def release_sequences(self, queue: str) -> int:
        with wrap_errors(f"release sequences of {queue}"):
            return int(await self._conn.fetchval(render("release_sequences", self._schema, queue)))

    async def isolate(
        self,
        queue: str,
        ids: Sequence[int],
        suspect: int,
        marks: Sequence[bool],
        claim: str,
        refunds: Sequence[int],
    ) -> int:
        with wrap_errors(f"isolate a message of {queue}"):
            changed = await self._conn.fetchval(
                render("isolate", self._schema, queue),
                list(ids),
                suspect,
                claim,
                list(marks),
                list(refunds),
            )
        return int(changed)

    @asynccontextmanager
    async def batch(self) -> AsyncIterator[PostgresBatch]:
        with wrap_errors("batch transaction"):
            batch = PostgresBatch(
                self._conn,
                self._schema,
                self._known,
                self._routed,
                self._floors,
                self._flow,
                self._lift,
                self._claim_check,
            )
            committing = False
            try:
                yield batch
                if batch.transaction is not None:
                    committing = True
                    await batch.transaction.commit()
            except BaseException:
                transaction = batch.transaction
                # A COMMIT that failed has rolled back already.
                if transaction is not None and not committing and not self._conn.is_closed():
                    await asyncio.shield(transaction.rollback())
                raise
