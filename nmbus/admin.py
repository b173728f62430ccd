"""The operations layer: every query and action an operator runs, in one place.

The ``nmbus`` commands are argument parsing and rendering over :class:`Admin`,
and a web page that shows queues or requeues a message uses the same methods
(as procrastinate's shell and CLI use its JobManager). The SQL stays in
``nmbus/postgres/sql/`` (``operations.sql`` and ``retention.sql``); results
are typed, never driver records; driver errors become nmbus errors.

Methods that read run in a read-only transaction, so PostgreSQL itself
refuses any write in them, and none of them creates a missing schema: they
raise QueueNotFound instead. Methods that write say so in their name
(``requeue_``, ``purge_``, ``run_``, ``create_``, ``drop_``)::

    async with Admin.from_settings(settings) as admin:
        for queue in await admin.queue_status():
            print(queue.queue, queue.ready, queue.failed)
        await admin.requeue_failed("billing", ids=[4711])
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import asyncpg

from nmbus.errors import ConfigurationError, QueueNotFound
from nmbus.logs import scrub
from nmbus.postgres import PostgresStore, notify_channel
from nmbus.postgres.errors import wrap_connect_errors, wrap_errors
from nmbus.postgres.sql import own_name, render
from nmbus.postgres.store import CREATED_BY_SEND
from nmbus.retention import ProgressCallback, RetentionPolicy, RetentionResult, clean_queue
from nmbus.settings import Settings
from nmbus.store import SCHEMA_VERSION, validate_queue_name, validate_schema_name

# Failed messages are requeued or purged this many per statement (and commit).
FAILED_BATCH = 1000
# Tables of at most this many pages (16 MiB) have their X rows (and sagas)
# counted exactly; bigger ones are estimated from the statistics system's
# live-row count, so a status never walks millions of processed rows.
EXACT_COUNT_PAGES = 2048
# A window reads at most this many of its newest X rows (and F rows): past it,
# percentiles describe the newest rows and the rate is measured over their span.
WINDOW_ROWS = 20_000
# queue_depths reads this many queues per statement (and transaction), so one
# read never holds the locks of hundreds of tables at once.
DEPTH_CHUNK = 20
# Ids are PostgreSQL bigints.
MAX_ID = 2**63 - 1
# Blocked sequences are counted up to this many per queue.
BLOCKED_SHOWN = 20


@dataclass(frozen=True, slots=True)
class BlockedSequence:
    """A sequence held back by its head: in F until requeued or purged, or in R."""

    sequence_key: str
    blocking_id: int
    subqueue: str
    attempts: int
    retry_time: datetime
    waiting: int  # members behind it, not yet processed
    error: str  # first line of the head's error_info


@dataclass(frozen=True, slots=True)
class WindowStats:
    """What a queue did in the last ``seconds``: read from at most WINDOW_ROWS newest rows."""

    seconds: float
    processed: int  # rows that went to X (a lower bound when sampled)
    failed: int  # rows that went to F (at most WINDOW_ROWS), over the same span as processed
    per_second: float  # X rows per second over the window (over the rows read, when sampled)
    avg_ms: float | None  # queue latency (last_processed - retry_time) of those X rows
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    sampled: bool  # more than WINDOW_ROWS rows went to X: figures are of the newest ones

    @property
    def failure_rate(self) -> float | None:
        """Share of the rows finished in the window that went to F (None: none finished)."""
        done = self.processed + self.failed
        return self.failed / done if done else None


@dataclass(frozen=True, slots=True)
class QueueStatus:
    """One queue at a glance: rows per subqueue, and what happened in the recent window.

    I, R and F are exact. X is exact on small tables and estimated on big ones
    (``processed_estimated``): see docs/dashboard.md, "Cost".
    """

    queue: str
    ready: int  # I
    scheduled: int  # R
    processed: int  # X (estimated when processed_estimated)
    failed: int  # F
    in_flight: int  # I/R rows held by a worker
    oldest_ready_seconds: float | None  # how long the oldest claimable row has waited
    recent_processed: int
    recent_avg_ms: float | None  # queue latency (last_processed - retry_time) of those
    recent_p99_ms: float | None
    recent_failed: int
    blocked: tuple[BlockedSequence, ...] = ()  # at most 20, F first
    processed_estimated: bool = False
    windows: tuple[WindowStats, ...] = ()  # the recent window first, then those asked for
    sagas: int | None = None  # rows of the endpoint's saga table; None: it has none
    sagas_estimated: bool = False
    # A send created the queue and no endpoint has started on it since (a typo?):
    # its table carries the mark of docs/operations.md. first_sender is the
    # endpoint that sent its oldest message (None: it holds none now).
    created_by_send: bool = False
    first_sender: str | None = None

    @property
    def created_by_send_note(self) -> str | None:
        """What the status and the dashboard say of a queue a send created (None: not one)."""
        if not self.created_by_send:
            return None
        sender = f" from {self.first_sender}" if self.first_sender else ""
        return f"created by a send{sender}, no endpoint has started on it"

    @property
    def ready_blocked(self) -> bool:
        """Ready rows, none claimable: all are members parked behind a blocked sequence's
        head (in F or R), so there is no oldest-ready age, and "blocked" says why."""
        return self.oldest_ready_seconds is None and self.ready > 0 and bool(self.blocked)


@dataclass(frozen=True, slots=True)
class QueueDepth:
    """A queue's depths without its recent windows: what :meth:`Admin.queue_depths` reads."""

    queue: str
    ready: int  # I
    scheduled: int  # R
    processed: int  # X (estimated when processed_estimated)
    failed: int  # F
    in_flight: int
    oldest_ready_seconds: float | None
    blocked: int  # blocked sequences, at most BLOCKED_SHOWN counted
    processed_estimated: bool = False
    created_by_send: bool = False  # as QueueStatus.created_by_send (its sender is not read)


@dataclass(frozen=True, slots=True)
class FailedCount:
    """How many failed messages of a queue matched, and what binds a change to them.

    Pass ``max_id`` and ``counted_at`` to :meth:`Admin.requeue_failed` or
    :meth:`Admin.purge_failed`: only rows up to that id that failed by that
    time change, so a message that fails after the count stays.
    """

    queue: str
    count: int
    max_id: int | None  # None: none matched
    counted_at: datetime


@dataclass(frozen=True, slots=True)
class HistoryBucket:
    """One bucket of a queue's recent history (counts are lower bounds at the read cap)."""

    start: datetime
    processed: int
    failed: int
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None


@dataclass(frozen=True, slots=True)
class FailedPage:
    """One page of failed messages, newest first; ``next_cursor`` continues it (None: last)."""

    messages: tuple[FailedMessage, ...]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class FailedMessage:
    """A failed (F) message, with the first line of its error."""

    queue: str
    id: int
    label: str | None
    retry_count: int
    insert_time: datetime
    last_processed: datetime | None
    error: str
    error_cut: bool = False  # the first line was longer than the page shows


@dataclass(frozen=True, slots=True)
class MessageRow:
    """Every column of one row of a queue table; the headers as JSON text.

    Read with ``max_chars``, error_info, msg_text and msg_headers are cut at
    that many characters; the ``*_chars`` fields give their whole lengths.
    """

    id: int
    from_endpoint: str
    to_endpoint: str
    subqueue: str
    insert_time: datetime
    last_processed: datetime | None
    retry_count: int
    retry_time: datetime
    error_info: str | None
    correlation_id: str | None
    label: str | None
    msg_text: str | None
    msg_headers: str | None
    unique_id: str
    handling_client_id: str | None
    lease_expires: datetime | None
    error_info_chars: int = 0
    msg_text_chars: int = 0
    msg_headers_chars: int = 0


@dataclass(frozen=True, slots=True)
class Subscription:
    """A subscriber's claim on a publisher's messages of one type; expired ones are not live."""

    publisher_endpoint: str
    subscriber_endpoint: str
    message_type: str
    created_date: datetime
    expiration_date: datetime | None
    live: bool


@dataclass(frozen=True, slots=True)
class RetentionDue:
    """How many rows of a queue retention would remove now."""

    queue: str
    processed: int  # X
    failed: int  # F


@dataclass(frozen=True, slots=True)
class OutboxBacklog:
    """Rows of the outbox waiting to be forwarded to one queue of another database."""

    queue: str
    waiting: int
    oldest_seconds: float | None  # age of the oldest: the forwarding lag


@dataclass(frozen=True, slots=True)
class RouteStatus:
    """One database the routes lead to (None: queues in the outbox with no route)."""

    database: str | None  # its DSN, without the password
    queues: tuple[OutboxBacklog, ...]
    reachable: bool | None  # None when not asked (no route)
    error: str | None = None

    @property
    def waiting(self) -> int:
        return sum(q.waiting for q in self.queues)


class Admin:
    """The operations on one nmbus schema, for the CLI and any other operator's tool.

    Open it with ``async with``; it connects on first use, with a pool of
    ``pool_size`` connections (one is enough for one caller at a time).
    """

    def __init__(self, dsn: str | None, schema: str = "nmbus", *, pool_size: int = 1) -> None:
        self.dsn = dsn
        self.schema = validate_schema_name(schema)
        self._pool_size = pool_size
        self._pool: asyncpg.Pool | None = None
        self._opening = asyncio.Lock()
        self._schema_seen = False

    @classmethod
    def from_settings(cls, settings: Settings, *, pool_size: int = 1) -> Admin:
        return cls(settings.dsn, settings.schema_name, pool_size=pool_size)

    @property
    def pool_size(self) -> int:
        """How many connections the pool may open: how many callers can read at once."""
        return self._pool_size

    def __repr__(self) -> str:
        dsn = scrub(self.dsn) if self.dsn else None
        return f"<Admin schema={self.schema!r} dsn={dsn!r}>"

    async def __aenter__(self) -> Admin:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await asyncio.shield(pool.close())

    # -- reads: a read-only transaction each, nothing created ------------------------------

    async def schema_exists(self) -> bool:
        """Whether the database holds this nmbus schema (none is made when it does not)."""
        async with self._session("look for the schema", read_only=True, schema=False) as conn:
            return await self._has_schema(conn)

    async def schema_version(self) -> int | None:
        """The schema's version (see nmbus.store.SCHEMA_VERSION); None: it has none yet."""
        async with self._session("read the schema version", read_only=True) as conn:
            version = await conn.fetchval(render("schema_version", self.schema))
            return None if version is None else int(version)

    async def list_queues(self) -> list[str]:
        """Names of every queue that has a table, sorted."""
        async with self._session("list queues", read_only=True) as conn:
            return await self._queues(conn)

    async def rows_estimate(self, queues: Sequence[str] | None = None) -> int:
        """Rows in every queue's table (or those of ``queues``), estimated without a scan."""
        async with self._session("estimate rows", read_only=True) as conn:
            names = await self._queues(conn, queues)
            return int(
                await conn.fetchval(render("ops_rows_estimate", self.schema), self.schema, names)
            )

    async def queue_status(
        self,
        window: float = 600.0,
        *,
        windows: Sequence[float] = (),
        exact: bool = False,
        queues: Sequence[str] | None = None,
    ) -> list[QueueStatus]:
        """Every queue (or those of ``queues``, in that order); ``recent_*`` (and
        ``windows[0]``) cover the last ``window`` seconds.

        Cheap by default: no scan of the X rows (see docs/dashboard.md, "Cost").
        ``windows`` adds more windows (seconds) to ``QueueStatus.windows``.
        ``exact=True`` is the old full pass over each table: X counted row by row.
        """
        _check_window(window, *windows)
        async with self._session("queue status", read_only=True) as conn:
            names = await self._queues(conn, queues)
            marked = await self._created_by_send(conn, names)
            found = []
            for name in names:
                status = await self._status_of(conn, name, (window, *windows), exact)
                if name in marked:
                    status = replace(status, created_by_send=True, first_sender=marked[name])
                found.append(status)
            return found

    async def queues_created_by_send(self) -> dict[str, str | None]:
        """Queues a send created that no endpoint has started on since, by name: each with
        the endpoint that sent its oldest message (None: it holds none now).

        A few statements whatever the number of queues: the list of queues, one
        read of the marks of every table (docs/operations.md), and one of the
        oldest row of each marked one.
        """
        async with self._session("queues created by a send", read_only=True) as conn:
            return await self._created_by_send(conn, await self._queues(conn))

    async def _created_by_send(self, conn: Any, names: Sequence[str]) -> dict[str, str | None]:
        """Which of ``names`` carry the mark of a queue a send created, with their first sender."""
        sql = render("ops_marked_queues", self.schema)
        marks = {r["name"] for r in await conn.fetch(sql, self.schema, CREATED_BY_SEND)}
        marked = [n for n in names if n in marks]
        found: dict[str, str | None] = dict.fromkeys(marked)
        for k, row in await self._each_queue(conn, "ops_first_sender", marked):
            found[marked[k]] = row["sender"]
        return found

    async def queue_depths(self) -> list[QueueDepth]:
        """Every queue's depths, by name, in a few statements whatever the number of queues.

        The figures of :meth:`queue_status` without its windows (X estimated on
        big tables the same way), for a page or a scrape over many queues: one
        statement reads the sizes of every table, then one per DEPTH_CHUNK
        queues their depths, and one the exact X count of the small ones.
        """
        async with self._session("queue depths", read_only=True) as conn:
            sizes = await conn.fetch(render("ops_queue_sizes", self.schema), self.schema)
        names = [r["name"] for r in sizes]
        small = {r["name"] for r in sizes if r["pages"] <= EXACT_COUNT_PAGES}
        depths: dict[str, dict[str, Any]] = {}
        exact: dict[str, int] = {}
        for start in range(0, len(names), DEPTH_CHUNK):
            chunk = names[start : start + DEPTH_CHUNK]
            async with self._session("queue depths", read_only=True) as conn:
                for k, row in await self._each_queue(conn, "ops_queue_depth", chunk, BLOCKED_SHOWN):
                    depths[chunk[k]] = {f: v for f, v in row.items() if f != "k"}
                counted = [n for n in chunk if n in small]
                for k, row in await self._each_queue(conn, "ops_count_processed", counted):
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

    async def _each_queue(
        self, conn: Any, block: str, names: Sequence[str], *args: Any
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
            f"SELECT {k}::int AS k, b.* FROM ({render(block, self.schema, name).rstrip(';')}) AS b"
            for k, name in enumerate(names)
        ]
        try:
            async with conn.transaction():  # a savepoint: a missing table is not the end
                rows = await conn.fetch("\nUNION ALL\n".join(parts), *args)
        except asyncpg.UndefinedTableError:
            here = set(await self._queues(conn))
            kept = [(k, n) for k, n in enumerate(names) if n in here]
            again = await self._each_queue(conn, block, [n for _, n in kept], *args)
            return [(kept[k][0], row) for k, row in again]
        return [(int(r["k"]), r) for r in rows]

    async def outbox_backlog(self) -> list[OutboxBacklog]:
        """What waits in this database's outbox, per destination queue (one scan)."""
        async with self._session("outbox backlog", read_only=True) as conn:
            has = "SELECT to_regclass(format('%I.outbox', $1::text))"
            if not await conn.fetchval(has, self.schema):
                return []  # a schema older than version 6 has no outbox
            rows = await conn.fetch(render("ops_outbox_status", self.schema))
            return [OutboxBacklog(**dict(r)) for r in rows]

    async def route_status(
        self, routes: Mapping[str, str], timeout: float = 5.0
    ) -> list[RouteStatus]:
        """Every database of ``routes`` (queue -> DSN): reachable or not, and its backlog here.

        Each remote is asked for one ``SELECT 1`` on a connection of its own,
        at most ``timeout`` seconds; queues with rows in the outbox but no route
        come last, as ``database=None``.
        """
        backlog = {b.queue: b for b in await self.outbox_backlog()}
        by_dsn: dict[str, list[str]] = {}
        for queue, dsn in sorted(routes.items()):
            by_dsn.setdefault(dsn, []).append(queue)
        found = []
        for dsn, queues in by_dsn.items():
            error = await _probe(dsn, timeout)
            found.append(
                RouteStatus(
                    scrub(dsn),
                    tuple(backlog.get(q, OutboxBacklog(q, 0, None)) for q in queues),
                    error is None,
                    error,
                )
            )
        lost = tuple(b for q, b in sorted(backlog.items()) if q not in routes)
        if lost:
            found.append(RouteStatus(None, lost, None, "no route for these queues"))
        return found

    async def _status_of(
        self, conn: Any, name: str, windows: Sequence[float], exact: bool
    ) -> QueueStatus:
        heads = await conn.fetch(render("ops_blocked_sequences", self.schema, name), 20)
        blocked = tuple(BlockedSequence(**dict(h)) for h in heads)
        stats = tuple([await self._window(conn, name, w) for w in windows])
        sagas, sagas_estimated = await self._saga_count(conn, name)
        if exact:
            row = dict(
                await conn.fetchrow(render("ops_queue_status", self.schema, name), windows[0])
            )
            estimated = False
        else:
            counts = dict(
                await conn.fetchrow(
                    render("ops_queue_counts", self.schema, name), self.schema, name
                )
            )
            live, pages = int(counts.pop("live_rows")), int(counts.pop("pages"))
            if pages <= EXACT_COUNT_PAGES:
                processed = int(
                    await conn.fetchval(render("ops_count_processed", self.schema, name))
                )
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

    async def _window(self, conn: Any, name: str, seconds: float) -> WindowStats:
        row = await conn.fetchrow(render("ops_window", self.schema, name), seconds, WINDOW_ROWS)
        processed, since = int(row["processed"]), row["since"]
        sampled = processed >= WINDOW_ROWS
        span = seconds
        if sampled and since is not None:
            span = max((row["now"] - since).total_seconds(), 1e-3)
        return WindowStats(
            seconds=seconds,
            processed=processed,
            failed=int(row["failed"]),
            per_second=processed / span,
            avg_ms=row["avg_ms"],
            p50_ms=row["p50_ms"],
            p95_ms=row["p95_ms"],
            p99_ms=row["p99_ms"],
            sampled=sampled,
        )

    async def _saga_count(self, conn: Any, name: str) -> tuple[int | None, bool]:
        saga_table = own_name(name, "saga")
        row = await conn.fetchrow(render("ops_table_rows", self.schema), self.schema, saga_table)
        if row is None:
            return None, False
        live, pages = row
        if pages is not None and pages <= EXACT_COUNT_PAGES:
            return int(await conn.fetchval(render("ops_saga_count", self.schema, name))), False
        return int(live or 0), True

    async def queue_history(
        self, queue: str, *, bucket_seconds: float = 60.0, buckets: int = 60, cap: int = 5000
    ) -> list[HistoryBucket]:
        """``queue``'s last ``buckets`` buckets, oldest first; each reads at most ``cap`` rows."""
        _check_window(bucket_seconds)
        if not 1 <= buckets <= 1440 or cap < 1:
            raise ConfigurationError("history: 1-1440 buckets and a positive cap")
        async with self._session(f"history of {queue}", read_only=True) as conn:
            await self._queue(conn, queue)
            sql = render("ops_history", self.schema, queue)
            rows = await conn.fetch(sql, bucket_seconds, buckets, cap)
            return [HistoryBucket(**dict(r)) for r in rows]

    async def queue_detail(
        self, queue: str, windows: Sequence[float] = (300.0, 3600.0)
    ) -> QueueStatus:
        """One queue's status (cheap, as :meth:`queue_status`), with these windows."""
        _check_window(*windows)
        async with self._session(f"status of {queue}", read_only=True) as conn:
            await self._queue(conn, queue)
            status = await self._status_of(conn, queue, windows, exact=False)
            marked = await self._created_by_send(conn, [queue])
            if queue in marked:
                status = replace(status, created_by_send=True, first_sender=marked[queue])
            return status

    async def failed_messages(
        self, queue: str | None = None, *, message_type: str | None = None, limit: int = 100
    ) -> list[FailedMessage]:
        """Failed messages of ``queue`` (None: every queue), oldest first, ``limit`` per queue."""
        async with self._session("list failed messages", read_only=True) as conn:
            names = [await self._queue(conn, queue)] if queue else await self._queues(conn)
            found: list[FailedMessage] = []
            for name in names:
                sql = render("ops_failed_list", self.schema, name)
                rows = await conn.fetch(sql, message_type, limit)
                found.extend(FailedMessage(name, **dict(r)) for r in rows)
            return found

    async def message(
        self, queue: str, message_id: int, *, max_chars: int | None = None
    ) -> MessageRow | None:
        """Every column of message ``message_id`` of ``queue``, whatever its subqueue.

        ``max_chars`` cuts its error, body and headers (see :class:`MessageRow`).
        """
        if max_chars is not None and max_chars < 0:
            raise ConfigurationError(f"max_chars must be 0 or more, got {max_chars}")
        async with self._session(f"show a message of {queue}", read_only=True) as conn:
            await self._queue(conn, queue)
            sql = render("ops_message", self.schema, queue)
            row = await conn.fetchrow(sql, message_id, max_chars)
            return None if row is None else MessageRow(**dict(row))

    async def message_text(self, queue: str, message_id: int, part: str) -> str | None:
        """One text of a message, whole: ``part`` is "error", "body" or "headers" (JSON).

        Raises QueueNotFound when there is no such message; None: it has no such text.
        """
        if part not in ("error", "body", "headers"):
            raise ConfigurationError(f"part must be error, body or headers, got {part!r}")
        async with self._session(f"show a message of {queue}", read_only=True) as conn:
            await self._queue(conn, queue)
            sql = render("ops_message_text", self.schema, queue)
            row = await conn.fetchrow(sql, message_id, part)
            if row is None:
                raise QueueNotFound(f"no message {message_id} in queue {queue!r}")
            return row["text"]  # type: ignore[no-any-return]

    async def failed_page(
        self,
        queue: str | None = None,
        *,
        message_type: str | None = None,
        error_contains: str | None = None,
        cursor: str | None = None,
        limit: int = 50,
        error_chars: int = 1000,
    ) -> FailedPage:
        """Failed messages of ``queue`` (None: every queue, by name), newest first, a page.

        ``error_contains`` matches error_info as plain text in any case. Pass
        the returned ``next_cursor`` back as ``cursor`` for the next page.
        Each error line is cut at ``error_chars`` characters (``error_cut``).
        """
        if not 1 <= limit <= 1000:
            raise ConfigurationError(f"page size must be 1-1000, got {limit}")
        after_queue, before_id = _parse_cursor(cursor)
        async with self._session("list failed messages", read_only=True) as conn:
            names = [await self._queue(conn, queue)] if queue else await self._queues(conn)
            if after_queue is not None:
                names = [n for n in names if n >= after_queue]
            found: list[FailedMessage] = []
            for name in names:
                below = before_id if name == after_queue else None
                sql = render("ops_failed_page", self.schema, name)
                want = limit + 1 - len(found)
                rows = await conn.fetch(
                    sql, below, message_type, error_contains or None, want, error_chars
                )
                found.extend(FailedMessage(name, **dict(r)) for r in rows)
                if len(found) > limit:
                    break
            if len(found) > limit:
                last = found[limit - 1]
                return FailedPage(tuple(found[:limit]), f"{last.queue}:{last.id}")
            return FailedPage(tuple(found), None)

    async def count_failed(
        self,
        queue: str,
        *,
        ids: Sequence[int] | None = None,
        message_type: str | None = None,
        error_contains: str | None = None,
    ) -> int:
        """How many failed messages of ``queue`` match: ids, type, error text (None: any)."""
        found = await self.failed_count(
            queue, ids=ids, message_type=message_type, error_contains=error_contains
        )
        return found.count

    async def failed_count(
        self,
        queue: str,
        *,
        ids: Sequence[int] | None = None,
        message_type: str | None = None,
        error_contains: str | None = None,
    ) -> FailedCount:
        """As :meth:`count_failed`, with what binds a later change to the rows counted."""
        async with self._session(f"count failed messages of {queue}", read_only=True) as conn:
            await self._queue(conn, queue)
            sql = render("ops_failed_count", self.schema, queue)
            row = await conn.fetchrow(sql, ids, message_type, error_contains or None)
            return FailedCount(queue, int(row["n"]), row["max_id"], row["counted_at"])

    async def subscriptions(
        self, publisher: str | None = None, *, live_only: bool = False
    ) -> list[Subscription]:
        """Every subscription (of ``publisher`` only, if given), expired ones unless live_only."""
        async with self._session("list subscriptions", read_only=True) as conn:
            rows = await conn.fetch(render("ops_subscriptions", self.schema), publisher)
        found = [Subscription(**dict(r)) for r in rows]
        return [s for s in found if s.live or not live_only]

    async def retention_due(
        self, policy: RetentionPolicy, queues: Sequence[str] | None = None
    ) -> list[RetentionDue]:
        """What :meth:`run_retention` would remove from ``queues`` (None: every queue)."""
        async with self._session("count old rows", read_only=True) as conn:
            found = []
            for name in await self._queues(conn, queues):
                sql = render("retention_count", self.schema, name)
                row = await conn.fetchrow(sql, policy.max_age, policy.failed_max_age)
                found.append(RetentionDue(name, processed=int(row[0]), failed=int(row[1])))
            return found

    # -- writes ----------------------------------------------------------------------------

    async def requeue_failed(
        self,
        queue: str,
        *,
        ids: Sequence[int] | None = None,
        message_type: str | None = None,
        error_contains: str | None = None,
        every: bool = False,
        on_batch: ProgressCallback | None = None,
        counted: FailedCount | None = None,
    ) -> int:
        """Move failed messages back to I as fresh messages, and wake the queue's workers.

        Say which: ``ids``, ``message_type`` and/or ``error_contains`` (plain
        text in error_info, any case), or ``every=True``. Attempts restart at 0,
        they are ready now, any lease is cleared; error_info is kept until the
        next attempt overwrites it. ``counted`` (from :meth:`failed_count` with
        the same filters) leaves alone what failed after that count. Returns
        how many moved.
        """
        channel = notify_channel(self.schema)
        error = error_contains or None
        max_id, until = _bound(queue, counted)
        return await self._failed_in_batches(
            "requeue",
            queue,
            (ids, message_type, error),
            every,
            on_batch,
            (ids, message_type, channel, FAILED_BATCH, queue, error, max_id, until),
        )

    async def purge_failed(
        self,
        queue: str,
        *,
        ids: Sequence[int] | None = None,
        message_type: str | None = None,
        error_contains: str | None = None,
        every: bool = False,
        on_batch: ProgressCallback | None = None,
        counted: FailedCount | None = None,
    ) -> int:
        """Delete failed messages for good (say which, as for requeue); returns how many."""
        error = error_contains or None
        max_id, until = _bound(queue, counted)
        return await self._failed_in_batches(
            "purge",
            queue,
            (ids, message_type, error),
            every,
            on_batch,
            (ids, message_type, FAILED_BATCH, error, max_id, until),
        )

    async def run_retention(
        self,
        policy: RetentionPolicy,
        queues: Sequence[str] | None = None,
        on_batch: ProgressCallback | None = None,
    ) -> list[RetentionResult]:
        """Remove (and archive, if the policy says so) old rows: see :mod:`nmbus.retention`."""
        async with self._session("retention", read_only=False) as conn:
            return [
                await clean_queue(conn, self.schema, name, policy, on_batch)
                for name in await self._queues(conn, queues)
            ]

    async def create_queues(self, names: Sequence[str]) -> None:
        """Create the schema if it is missing, and a table for each queue that has none."""
        checked = [validate_queue_name(n) for n in names]
        async with self._store() as store:
            for name in checked:
                await store.ensure_queue(name)

    async def drop_queues(self, names: Sequence[str]) -> list[str]:
        """Drop queue tables and every message in them; all must exist, or none is dropped."""
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
                    self._pool = await asyncpg.create_pool(
                        self.dsn,
                        min_size=1,
                        max_size=self._pool_size,
                        timeout=10,
                        server_settings={"jit": "off"},
                    )
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

    async def _failed_in_batches(
        self,
        verb: str,
        queue: str,
        filters: tuple[Any, ...],  # ids, message_type, error_contains
        every: bool,
        on_batch: ProgressCallback | None,
        params: tuple[Any, ...],  # the query's parameters
    ) -> int:
        if every == any(filters):
            raise ConfigurationError(
                f"{verb}: say which failed messages, ids, message_type and/or "
                "error_contains, or every=True"
            )
        async with self._session(f"{verb} failed messages of {queue}", read_only=False) as conn:
            await self._queue(conn, queue)
            sql = render(f"ops_{verb}_failed", self.schema, queue)
            done = 0
            while True:
                changed = int(await conn.fetchval(sql, *params))
                done += changed
                if on_batch is not None:
                    on_batch(queue, changed)
                if changed < FAILED_BATCH:
                    return done

    @asynccontextmanager
    async def _store(self) -> AsyncIterator[PostgresStore]:
        # Connect as reads do first: a DSN that cannot work is an InvalidSetting here too.
        await self._connection_pool()
        store = PostgresStore(self.dsn, self.schema, 1)
        await store.open()
        try:
            yield store
        finally:
            await store.close()


async def _probe(dsn: str, timeout: float) -> str | None:
    """Why the database at ``dsn`` cannot be used now (one line, no password), or None."""
    try:
        conn = await asyncpg.connect(dsn, timeout=timeout)
    except Exception as exc:
        return scrub(f"{type(exc).__name__}: {exc}")
    try:
        await conn.fetchval("SELECT 1", timeout=timeout)
    except Exception as exc:
        return scrub(f"{type(exc).__name__}: {exc}")
    finally:
        conn.terminate()
    return None


def _bound(queue: str, counted: FailedCount | None) -> tuple[int | None, datetime | None]:
    if counted is None:
        return None, None
    if counted.queue != queue:
        raise ConfigurationError(f"a count of queue {counted.queue!r} cannot bind {queue!r}")
    # Nothing matched then: nothing may change now (id 0 is below every id).
    return (counted.max_id if counted.max_id is not None else 0), counted.counted_at


def _check_window(*seconds: float) -> None:
    for value in seconds:
        if not 0 < value <= 366 * 86400:
            raise ConfigurationError(f"a window must be 0-366 days in seconds, got {value!r}")


def _parse_cursor(cursor: str | None) -> tuple[str | None, int | None]:
    """``queue:id`` as failed_page returns it: the page goes on below that message."""
    if not cursor:
        return None, None
    queue, _, ident = cursor.rpartition(":")
    if not queue or not ident.isdigit() or len(ident) > 19 or int(ident) > MAX_ID:
        raise ConfigurationError(f"not a page cursor: {cursor[:80]!r}")
    return queue, int(ident)


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
