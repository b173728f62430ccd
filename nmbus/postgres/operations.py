"""The operations port on PostgreSQL: every query and action of :class:`nmbus.ops.admin.Admin`.

The SQL is the ``ops_*`` and ``retention_*`` blocks; results are typed
(:mod:`nmbus.ports.operations`), never driver records; driver errors become nmbus
errors. Methods that read run in a read-only transaction, so PostgreSQL itself
refuses any write in them, and none of them creates a missing schema: they
raise QueueNotFound instead. The pool (``pool_size`` connections) opens on
first use.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, nullcontext
from dataclasses import replace
from typing import Any

import asyncpg

from nmbus.delivery.cancellation import Cancel
from nmbus.delivery.flow import LimitStatus
from nmbus.errors import QueueNotFound
from nmbus.logs import scrub
from nmbus.names import validate_queue_name, validate_schema_name
from nmbus.ports.operations import (
    FailedCount,
    FailedFilter,
    FailedMessage,
    HistoryBucket,
    MessageRow,
    OutboxBacklog,
    ProgressCallback,
    QueueDepth,
    QueueStatus,
    ReadLimits,
    RetentionDue,
    RetentionPolicy,
    RetentionResult,
    SegmentInfo,
    Subscription,
)
from nmbus.ports.store import SCHEMA_VERSION, Readiness
from nmbus.postgres.cancel import cancel_on
from nmbus.postgres.errors import wrap_connect_errors, wrap_errors
from nmbus.postgres.flow import flow_status_on
from nmbus.postgres.listen import notify_channel
from nmbus.postgres.pooler import Pooler
from nmbus.postgres.primary import refuse_read_only
from nmbus.postgres.reclaim import due
from nmbus.postgres.retention import clean_queue
from nmbus.postgres.schema import CREATED_BY_SEND, readiness_on
from nmbus.postgres.segments import segments
from nmbus.postgres.sql import render
from nmbus.postgres.status import created_by_send, each_queue, segments_of, status_of
from nmbus.postgres.store import PostgresStore

# queue_depths reads this many queues per statement (and transaction), so one
# read never holds the locks of hundreds of tables at once.
DEPTH_CHUNK = 20


class PostgresOperations:
    """The operations on one nmbus schema of a PostgreSQL database."""

    def __init__(
        self,
        dsn: str | None,
        schema: str = "nmbus",
        pool_size: int = 1,
        pooler: Pooler | None = None,
    ) -> None:
        self.dsn = dsn
        self.pooler = pooler or Pooler()
        self.schema = validate_schema_name(schema)
        self.pool_size = pool_size
        self._pool: asyncpg.Pool | None = None
        self._opening = asyncio.Lock()
        self._schema_seen = False

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await asyncio.shield(pool.close())

    # -- reads: a read-only transaction each, nothing created ------------------------------

    async def schema_exists(self) -> bool:
        async with self._session("look for the schema", read_only=True, schema=False) as conn:
            return await self._has_schema(conn)

    async def schema_version(self) -> int | None:
        async with self._session("read the schema version", read_only=True) as conn:
            version = await conn.fetchval(render("schema_version", self.schema))
            return None if version is None else int(version)

    async def list_queues(self) -> list[str]:
        async with self._session("list queues", read_only=True) as conn:
            return await self._queues(conn)

    async def readiness(self, queue: str) -> Readiness:
        async with self._session("check readiness", read_only=True, schema=False) as conn:
            return await readiness_on(conn, self.schema, queue)

    async def rows_estimate(self, queues: Sequence[str] | None) -> int:
        async with self._session("estimate rows", read_only=True) as conn:
            names = await self._queues(conn, queues)
            sql = render("ops_rows_estimate", self.schema)
            return int(await conn.fetchval(sql, self.schema, names))

    async def queue_status(
        self,
        windows: Sequence[float],
        exact: bool,
        queues: Sequence[str] | None,
        limits: ReadLimits,
    ) -> list[QueueStatus]:
        async with self._session("queue status", read_only=True) as conn:
            names = await self._queues(conn, queues)
            marked = await self._created_by_send(conn, names)
            found = []
            for name in names:
                status = await status_of(conn, self.schema, name, windows, exact, limits)
                if name in marked:
                    status = replace(status, created_by_send=True, first_sender=marked[name])
                found.append(status)
            return found

    async def queue_detail(
        self, queue: str, windows: Sequence[float], limits: ReadLimits
    ) -> QueueStatus:
        async with self._session(f"status of {queue}", read_only=True) as conn:
            await self._queue(conn, queue)
            status = await status_of(conn, self.schema, queue, windows, False, limits)
            marked = await self._created_by_send(conn, [queue])
            if queue in marked:
                status = replace(status, created_by_send=True, first_sender=marked[queue])
            return status

    async def queues_created_by_send(self) -> dict[str, str | None]:
        async with self._session("queues created by a send", read_only=True) as conn:
            return await self._created_by_send(conn, await self._queues(conn))

    async def queue_depths(self, limits: ReadLimits) -> list[QueueDepth]:
        """One statement reads the sizes of every table, then one per DEPTH_CHUNK queues
        their depths, and one the exact X count of the small ones."""
        async with self._session("queue depths", read_only=True) as conn:
            sizes = await conn.fetch(render("ops_queue_sizes", self.schema), self.schema)
        names = [r["name"] for r in sizes]
        small = {r["name"] for r in sizes if r["pages"] <= limits.exact_count_pages}
        depths: dict[str, dict[str, Any]] = {}
        exact: dict[str, int] = {}
        for start in range(0, len(names), DEPTH_CHUNK):
            chunk = names[start : start + DEPTH_CHUNK]
            async with self._session("queue depths", read_only=True) as conn:
                shown = limits.blocked_shown
                for k, row in await self._each(conn, "ops_queue_depth", chunk, shown):
                    depths[chunk[k]] = {f: v for f, v in row.items() if f != "k"}
                counted = [n for n in chunk if n in small]
                for k, row in await self._each(conn, "ops_count_processed", counted):
                    exact[counted[k]] = int(row["count"])
        found = []
        for size in sizes:
            name = size["name"]
            if name not in depths:
                continue  # dropped while it was read
            row = depths[name]
            if name in exact:
                processed, estimated = exact[name], False
            else:
                open_rows = row["ready"] + row["scheduled"] + row["failed"]
                processed, estimated = max(int(size["live_rows"]) - open_rows, 0), True
            found.append(
                QueueDepth(
                    name,
                    processed=processed,
                    processed_estimated=estimated,
                    created_by_send=size["note"] == CREATED_BY_SEND,
                    **row,
                )
            )
        return found

    async def queue_segments(self, queues: Sequence[str] | None) -> list[SegmentInfo]:
        """One read of the catalogue for every queue, then one statement per queue."""
        async with self._session("list segments", read_only=True) as conn:
            return await segments_of(conn, self.schema, await self._queues(conn, queues))

    async def flow_status(self, queues: Sequence[str] | None) -> list[LimitStatus]:
        async with self._session("read the flow limits", read_only=True) as conn:
            names = set(await self._queues(conn, queues))
            return await flow_status_on(conn, self.schema, names)

    async def queue_history(
        self, queue: str, bucket_seconds: float, buckets: int, cap: int
    ) -> list[HistoryBucket]:
        async with self._session(f"history of {queue}", read_only=True) as conn:
            await self._queue(conn, queue)
            sql = render("ops_history", self.schema, queue)
            rows = await conn.fetch(sql, bucket_seconds, buckets, cap)
            return [HistoryBucket(**dict(r)) for r in rows]

    async def failed_messages(
        self, queue: str | None, message_type: str | None, limit: int
    ) -> list[FailedMessage]:
        async with self._session("list failed messages", read_only=True) as conn:
            names = [await self._queue(conn, queue)] if queue else await self._queues(conn)
            found: list[FailedMessage] = []
            for name in names:
                sql = render("ops_failed_list", self.schema, name)
                rows = await conn.fetch(sql, message_type, limit)
                found.extend(FailedMessage(name, **dict(r)) for r in rows)
            return found

    async def failed_page(
        self,
        queue: str | None,
        after: tuple[str, int] | None,
        message_type: str | None,
        error_contains: str | None,
        limit: int,
        error_chars: int,
    ) -> list[FailedMessage]:
        async with self._session("list failed messages", read_only=True) as conn:
            names = [await self._queue(conn, queue)] if queue else await self._queues(conn)
            if after is not None:
                names = [n for n in names if n >= after[0]]
            found: list[FailedMessage] = []
            for name in names:
                below = after[1] if after is not None and name == after[0] else None
                sql = render("ops_failed_page", self.schema, name)
                want = limit - len(found)
                rows = await conn.fetch(sql, below, message_type, error_contains, want, error_chars)
                found.extend(FailedMessage(name, **dict(r)) for r in rows)
                if len(found) >= limit:
                    break
            return found

    async def failed_count(
        self,
        queue: str,
        ids: Sequence[int] | None,
        message_type: str | None,
        error_contains: str | None,
    ) -> FailedCount:
        async with self._session(f"count failed messages of {queue}", read_only=True) as conn:
            await self._queue(conn, queue)
            sql = render("ops_failed_count", self.schema, queue)
            row = await conn.fetchrow(sql, _ids(ids), message_type, error_contains)
            return FailedCount(queue, int(row["n"]), row["max_id"], row["counted_at"])

    async def message(
        self, queue: str, message_id: int, max_chars: int | None
    ) -> MessageRow | None:
        async with self._session(f"show a message of {queue}", read_only=True) as conn:
            await self._queue(conn, queue)
            sql = render("ops_message", self.schema, queue)
            row = await conn.fetchrow(sql, message_id, max_chars)
            return None if row is None else MessageRow(**dict(row))

    async def message_text(self, queue: str, message_id: int, part: str) -> str | None:
        async with self._session(f"show a message of {queue}", read_only=True) as conn:
            await self._queue(conn, queue)
            sql = render("ops_message_text", self.schema, queue)
            row = await conn.fetchrow(sql, message_id, part)
            if row is None:
                raise QueueNotFound(f"no message {message_id} in queue {queue!r}")
            return row["text"]  # type: ignore[no-any-return]

    async def subscriptions(self, publisher: str | None) -> list[Subscription]:
        async with self._session("list subscriptions", read_only=True) as conn:
            rows = await conn.fetch(render("ops_subscriptions", self.schema), publisher)
        return [Subscription(**dict(r)) for r in rows]

    async def outbox_backlog(self) -> list[OutboxBacklog]:
        async with self._session("outbox backlog", read_only=True) as conn:
            has = "SELECT to_regclass(format('%I.outbox', $1::text))"
            if not await conn.fetchval(has, self.schema):
                return []  # a schema older than version 6 has no outbox
            rows = await conn.fetch(render("ops_outbox_status", self.schema))
            return [OutboxBacklog(**dict(r)) for r in rows]

    async def probe(self, dsn: str, timeout: float) -> str | None:
        return await probe(dsn, timeout, self.pooler)

    async def retention_due(
        self, policy: RetentionPolicy, queues: Sequence[str] | None
    ) -> list[RetentionDue]:
        async with self._session("count old rows", read_only=True) as conn:
            found = []
            for name in await self._queues(conn, queues):
                if await segments(conn, self.schema, name):
                    processed, failed = await due(conn, self.schema, name, policy)
                else:
                    sql = render("retention_count", self.schema, name)
                    row = await conn.fetchrow(sql, policy.max_age, policy.failed_max_age)
                    processed, failed = int(row[0]), int(row[1])
                found.append(RetentionDue(name, processed=processed, failed=failed))
            return found

    # -- writes ----------------------------------------------------------------------------

    async def requeue_failed(self, queue: str, chosen: FailedFilter, limit: int) -> int:
        channel = notify_channel(self.schema)
        args = (_ids(chosen.ids), chosen.message_type, channel, limit, queue, chosen.error_contains)
        return await self._failed_batch("requeue", queue, (*args, chosen.max_id, chosen.failed_by))

    async def purge_failed(self, queue: str, chosen: FailedFilter, limit: int) -> int:
        args = (_ids(chosen.ids), chosen.message_type, limit, chosen.error_contains)
        return await self._failed_batch("purge", queue, (*args, chosen.max_id, chosen.failed_by))

    async def cancel(self, queue: str, request: Cancel) -> int:
        async with self._session(f"cancel in {queue}", read_only=False) as conn:
            return await cancel_on(conn, self.schema, await self._queue(conn, queue), request)

    async def run_retention(
        self,
        policy: RetentionPolicy,
        queues: Sequence[str] | None,
        on_batch: ProgressCallback | None,
    ) -> list[RetentionResult]:
        async with (
            self._session("retention", read_only=False) as conn,
            self.pooler.lock_holder(self.dsn) as holder,
        ):
            return [
                await clean_queue(conn, self.schema, name, policy, on_batch, holder)
                for name in await self._queues(conn, queues)
            ]

    async def create_queues(self, names: Sequence[str]) -> None:
        async with self._store() as store:
            for name in names:
                await store.ensure_queue(name)

    async def drop_queues(self, names: Sequence[str]) -> list[str]:
        # Look before opening the store: opening it installs a missing schema.
        async with self._session("drop queues", read_only=True) as conn:
            await self._queues(conn, names, missing="; nothing dropped")
        async with self._store() as store:
            for name in names:
                await store.drop_queue(name)
        return list(names)

    # -- plumbing --------------------------------------------------------------------------

    async def _connection_pool(self) -> asyncpg.Pool:
        async with self._opening:
            if self._pool is None:
                with wrap_connect_errors(self.dsn):
                    # JIT compiling pays only for long scans: the operations layer
                    # runs short index-bound reads, which the planner's pessimistic
                    # estimate for a history of many buckets would send through a
                    # compile of ~0.5 s (measured on 4M rows: 35 ms without it).
                    # Behind a transaction pooler JIT stays as the server has it.
                    pool = await asyncpg.create_pool(
                        self.dsn,
                        min_size=1,
                        max_size=self.pool_size,
                        timeout=10,
                        **self.pooler.pool_options({"jit": "off"}),
                    )
                try:
                    with wrap_errors("open"):
                        async with pool.acquire() as conn:
                            # A standby's figures lag and its writes fail: refused. A role
                            # or database read-only by default reads (its writes fail with
                            # the server's own error): how a viewer is given access.
                            await refuse_read_only(conn, self.dsn, standby_only=True)
                except BaseException:
                    await pool.close()
                    raise
                self._pool = pool
            return self._pool

    @asynccontextmanager
    async def _session(
        self, what: str, *, read_only: bool, schema: bool = True
    ) -> AsyncIterator[Any]:
        """A pooled connection (in a read-only transaction when reading) on an existing schema."""
        pool = await self._connection_pool()
        with wrap_errors(what):
            async with (
                pool.acquire() as conn,
                conn.transaction(readonly=True) if read_only else nullcontext(),
            ):
                if schema and not await self._has_schema(conn):
                    raise QueueNotFound(
                        f"no nmbus schema {self.schema!r} in this database: no queues"
                    )
                yield conn

    async def _has_schema(self, conn: Any) -> bool:
        if not self._schema_seen:
            sql = render("schema_exists", self.schema)
            self._schema_seen = bool(await conn.fetchval(sql, self.schema))
        return self._schema_seen

    async def _queue(self, conn: Any, queue: str) -> str:
        validate_queue_name(queue)
        if not await conn.fetchval(render("queue_exists", self.schema), self.schema, queue):
            raise QueueNotFound(f"no queue {queue!r} in schema {self.schema!r}")
        return queue

    async def _queues(
        self, conn: Any, wanted: Sequence[str] | None = None, missing: str = ""
    ) -> list[str]:
        """Every queue, or those ``wanted`` if all of them exist."""
        known = [r[0] for r in await conn.fetch(render("list_queues", self.schema), self.schema)]
        if wanted is None:
            return known
        if absent := [q for q in wanted if q not in known]:
            raise QueueNotFound(f"no such queue(s): {', '.join(absent)}{missing}")
        return list(wanted)

    async def _each(
        self, conn: Any, block: str, names: Sequence[str], *args: Any
    ) -> list[tuple[int, Any]]:
        return await each_queue(conn, self.schema, block, names, lambda: self._queues(conn), *args)

    async def _created_by_send(self, conn: Any, names: Sequence[str]) -> dict[str, str | None]:
        return await created_by_send(conn, self.schema, names, lambda: self._queues(conn))

    async def _failed_batch(self, verb: str, queue: str, params: tuple[Any, ...]) -> int:
        async with self._session(f"{verb} failed messages of {queue}", read_only=False) as conn:
            await self._queue(conn, queue)
            sql = render(f"ops_{verb}_failed", self.schema, queue)
            return int(await conn.fetchval(sql, *params))

    @asynccontextmanager
    async def _store(self) -> AsyncIterator[PostgresStore]:
        # Connect as reads do first: a DSN that cannot work is an InvalidSetting here too.
        await self._connection_pool()
        store = PostgresStore(self.dsn, self.schema, 1, pooler=self.pooler)
        await store.open()
        try:
            yield store
        finally:
            await store.close()


def _ids(ids: Sequence[int] | None) -> list[int] | None:
    return None if ids is None else list(ids)


async def probe(dsn: str, timeout: float, pooler: Pooler | None = None) -> str | None:
    """Why the database at ``dsn`` cannot be used now (one line, no password), or None."""
    try:
        conn = await asyncpg.connect(dsn, timeout=timeout, **(pooler or Pooler()).connect_options())
    except Exception as exc:
        return scrub(f"{type(exc).__name__}: {exc}")
    try:
        await conn.fetchval("SELECT 1", timeout=timeout)
    except Exception as exc:
        return scrub(f"{type(exc).__name__}: {exc}")
    finally:
        conn.terminate()
    return None


def schema_ddl(schema: str, queue: str) -> str:
    """The DDL nmbus runs for a new schema with one queue, as a psql script."""
    validate_schema_name(schema)
    validate_queue_name(queue)

    def literal(value: object) -> str:
        return "'" + str(value).replace("'", "''") + "'"

    # What a reader of the DDL needs, nothing about how nmbus's sources are kept.
    header = "\n".join(
        [
            f"-- The DDL nmbus runs for schema {schema!r} with the queue {queue!r}"
            f" (schema version {SCHEMA_VERSION}).",
            "-- nmbus creates all of this itself when a Bus starts; to run it by hand:",
            "--   psql -v ON_ERROR_STOP=1 -f FILE",
        ]
    )
    statements = [
        render("create_schema", schema),
        render("set_schema_version", schema).replace("$1", literal(SCHEMA_VERSION)),
        render("create_queue", schema, queue),
        render("register_queue", schema).replace("$1", literal(queue)),
    ]
    body = "\n\n".join(s.rstrip().rstrip(";") + ";" for s in statements)
    return f"{header}\n\nBEGIN;\n\n{body}\n\nCOMMIT;\n"
