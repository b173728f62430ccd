"""The operations layer: every query and action an operator runs, in one place.

The ``nmbus`` commands are argument parsing and rendering over :class:`Admin`,
and a web page that shows queues or requeues a message uses the same methods
(as procrastinate's shell and CLI use its JobManager). Admin checks what it is
asked, pages, and binds changes to counts; a store answers it through the
operations port (:mod:`nmbus.ports.operations`): PostgreSQL
(:mod:`nmbus.postgres.operations`, the ``ops_*`` and ``retention_*`` SQL
blocks), or the in-memory store of :mod:`nmbus.testing` (``Admin.over``).
Results are typed, never driver records; driver errors become nmbus errors.

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

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Protocol

from nmbus.delivery.cancellation import Cancel
from nmbus.errors import ConfigurationError
from nmbus.logs import scrub
from nmbus.names import validate_queue_name, validate_schema_name
from nmbus.ports.operations import (
    BlockedSequence,
    FailedCount,
    FailedFilter,
    FailedMessage,
    FailedPage,
    HistoryBucket,
    LimitStatus,
    MessageRow,
    Operations,
    OutboxBacklog,
    ProgressCallback,
    QueueDepth,
    QueueStatus,
    Readiness,
    ReadLimits,
    RetentionDue,
    RetentionPolicy,
    RetentionResult,
    RouteStatus,
    SegmentInfo,
    Subscription,
    WindowStats,
)
from nmbus.postgres.operations import DEPTH_CHUNK, PostgresOperations, schema_ddl
from nmbus.postgres.pooler import Pooler, PoolerMode
from nmbus.settings import Settings

__all__ = [
    "BLOCKED_SHOWN",
    "DEPTH_CHUNK",
    "EXACT_COUNT_PAGES",
    "FAILED_BATCH",
    "MAX_ID",
    "WINDOW_ROWS",
    "Admin",
    "BlockedSequence",
    "FailedCount",
    "FailedMessage",
    "FailedPage",
    "HistoryBucket",
    "LimitStatus",
    "MessageRow",
    "OutboxBacklog",
    "QueueDepth",
    "QueueStatus",
    "Readiness",
    "RetentionDue",
    "RetentionPolicy",
    "RetentionResult",
    "RouteStatus",
    "SegmentInfo",
    "Subscription",
    "WindowStats",
    "schema_ddl",
]

# Failed messages are requeued or purged this many per statement (and commit).
FAILED_BATCH = 1000
# Tables of at most this many pages (16 MiB) have their X rows (and sagas)
# counted exactly; bigger ones are estimated from the statistics system's
# live-row count, so a status never walks millions of processed rows.
EXACT_COUNT_PAGES = 2048
# A window reads at most this many of its newest X rows (and F rows): past it,
# percentiles describe the newest rows and the rate is measured over their span.
WINDOW_ROWS = 20_000
# Ids are PostgreSQL bigints.
MAX_ID = 2**63 - 1
# Blocked sequences are counted up to this many per queue.
BLOCKED_SHOWN = 20


class Admin:
    """The operations on one nmbus schema, for the CLI and any other operator's tool.

    Open it with ``async with``; it connects on first use, with a pool of
    ``pool_size`` connections (one is enough for one caller at a time).
    :meth:`over` builds one over any store that implements the operations port.
    """

    def __init__(
        self,
        dsn: str | None,
        schema: str = "nmbus",
        *,
        pool_size: int = 1,
        pooler: PoolerMode = "none",
    ) -> None:
        self.dsn = dsn
        self.schema = validate_schema_name(schema)
        self._pool_size = pool_size
        # pooler: what the DSN reaches, as the setting says (docs/deployment.md).
        self._ops: Operations = PostgresOperations(dsn, self.schema, pool_size, Pooler(pooler))

    @classmethod
    def from_settings(cls, settings: Settings, *, pool_size: int = 1) -> Admin:
        return cls(settings.dsn, settings.schema_name, pool_size=pool_size, pooler=settings.pooler)

    @classmethod
    def over(cls, operations: Operations, *, pool_size: int = 1) -> Admin:
        """An Admin over ``operations`` (PostgresOperations), which it closes on close.

        ``pool_size`` says how many callers it serves at once (see :attr:`pool_size`).
        """
        if not hasattr(operations, "queue_status"):
            raise ConfigurationError(
                f"{type(operations).__name__} has no operations: Admin, the dashboard and the "
                "command line run on PostgreSQL (PostgresOperations, or Admin(dsn))"
            )
        admin = cls.__new__(cls)
        admin.dsn = None
        admin.schema = validate_schema_name(operations.schema)
        admin._pool_size = pool_size
        admin._ops = operations
        return admin

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
        await self._ops.close()

    # -- reads: a read-only transaction each, nothing created ------------------------------

    async def schema_exists(self) -> bool:
        """Whether the database holds this nmbus schema (none is made when it does not)."""
        return await self._ops.schema_exists()

    async def schema_version(self) -> int | None:
        """The schema's version (see nmbus.ports.store.SCHEMA_VERSION); None: it has none yet."""
        return await self._ops.schema_version()

    async def list_queues(self) -> list[str]:
        """Names of every queue that has a table, sorted."""
        return await self._ops.list_queues()

    async def readiness(self, queue: str) -> Readiness:
        """What ``nmbus health`` checks: the schema's version and whether ``queue`` has its
        table (:meth:`Readiness.problem` says what is wrong, if anything)."""
        return await self._ops.readiness(validate_queue_name(queue))

    async def rows_estimate(self, queues: Sequence[str] | None = None) -> int:
        """Rows in every queue's table (or those of ``queues``), estimated without a scan."""
        return await self._ops.rows_estimate(queues)

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
        return await self._ops.queue_status((window, *windows), exact, queues, _limits())

    async def queues_created_by_send(self) -> dict[str, str | None]:
        """Queues a send created that no endpoint has started on since, by name: each with
        the endpoint that sent its oldest message (None: it holds none now).

        A few statements whatever the number of queues: the list of queues, one
        read of the marks of every table (docs/operations.md), and one of the
        oldest row of each marked one.
        """
        return await self._ops.queues_created_by_send()

    async def queue_depths(self) -> list[QueueDepth]:
        """Every queue's depths, by name, in a few statements whatever the number of queues.

        The figures of :meth:`queue_status` without its windows (X estimated on
        big tables the same way), for a page or a scrape over many queues: one
        statement reads the sizes of every table, then one per DEPTH_CHUNK
        queues their depths, and one the exact X count of the small ones.
        """
        return await self._ops.queue_depths(_limits())

    async def queue_segments(self, queues: Sequence[str] | None = None) -> list[SegmentInfo]:
        """The segments of every queue (or of ``queues``), by queue, then oldest first.

        A queue table that is not partitioned (an older schema, the in-memory
        store) is one segment, number 0. One read of the catalogue for every
        queue, then one statement per queue that probes its primary key and
        counts its rows not in X through the partial indexes: never a scan of
        its X rows. ``rows`` is an estimate; ``pending`` is exact.
        """
        checked = None if queues is None else [validate_queue_name(n) for n in queues]
        return await self._ops.queue_segments(checked)

    async def flow_status(self, queues: Sequence[str] | None = None) -> list[LimitStatus]:
        """Each handler with flow limits (docs/flow-control.md), of every queue or of
        ``queues``: its limits as last declared, its messages in flight, its starts in
        its rate's window, and the ready messages its limits hold back now."""
        checked = None if queues is None else [validate_queue_name(n) for n in queues]
        return await self._ops.flow_status(checked)

    async def outbox_backlog(self) -> list[OutboxBacklog]:
        """What waits in this database's outbox, per destination queue (one scan)."""
        return await self._ops.outbox_backlog()

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
            error = await self._ops.probe(dsn, timeout)
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

    async def queue_history(
        self, queue: str, *, bucket_seconds: float = 60.0, buckets: int = 60, cap: int = 5000
    ) -> list[HistoryBucket]:
        """``queue``'s last ``buckets`` buckets, oldest first; each reads at most ``cap`` rows."""
        _check_window(bucket_seconds)
        if not 1 <= buckets <= 1440 or cap < 1:
            raise ConfigurationError("history: 1-1440 buckets and a positive cap")
        return await self._ops.queue_history(queue, bucket_seconds, buckets, cap)

    async def queue_detail(
        self, queue: str, windows: Sequence[float] = (300.0, 3600.0)
    ) -> QueueStatus:
        """One queue's status (cheap, as :meth:`queue_status`), with these windows."""
        _check_window(*windows)
        return await self._ops.queue_detail(queue, windows, _limits())

    async def failed_messages(
        self, queue: str | None = None, *, message_type: str | None = None, limit: int = 100
    ) -> list[FailedMessage]:
        """Failed messages of ``queue`` (None: every queue), oldest first, ``limit`` per queue."""
        return await self._ops.failed_messages(queue, message_type, limit)

    async def message(
        self, queue: str, message_id: int, *, max_chars: int | None = None
    ) -> MessageRow | None:
        """Every column of message ``message_id`` of ``queue``, whatever its subqueue.

        ``max_chars`` cuts its error, body and headers (see :class:`MessageRow`).
        """
        if max_chars is not None and max_chars < 0:
            raise ConfigurationError(f"max_chars must be 0 or more, got {max_chars}")
        return await self._ops.message(queue, message_id, max_chars)

    async def message_text(self, queue: str, message_id: int, part: str) -> str | None:
        """One text of a message, whole: ``part`` is "error", "body" or "headers" (JSON).

        Raises QueueNotFound when there is no such message; None: it has no such text.
        """
        if part not in ("error", "body", "headers"):
            raise ConfigurationError(f"part must be error, body or headers, got {part!r}")
        return await self._ops.message_text(queue, message_id, part)

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
        after = _parse_cursor(cursor)
        found = await self._ops.failed_page(
            queue, after, message_type, error_contains or None, limit + 1, error_chars
        )
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
        return await self._ops.failed_count(queue, ids, message_type, error_contains or None)

    async def subscriptions(
        self, publisher: str | None = None, *, live_only: bool = False
    ) -> list[Subscription]:
        """Every subscription (of ``publisher`` only, if given), expired ones unless live_only."""
        found = await self._ops.subscriptions(publisher)
        return [s for s in found if s.live or not live_only]

    async def retention_due(
        self, policy: RetentionPolicy, queues: Sequence[str] | None = None
    ) -> list[RetentionDue]:
        """What :meth:`run_retention` would remove from ``queues`` (None: every queue)."""
        return await self._ops.retention_due(policy, queues)

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
        chosen = _chosen("requeue", queue, ids, message_type, error_contains, every, counted)
        return await self._in_batches(self._ops.requeue_failed, queue, chosen, on_batch)

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
        chosen = _chosen("purge", queue, ids, message_type, error_contains, every, counted)
        return await self._in_batches(self._ops.purge_failed, queue, chosen, on_batch)

    async def cancel(
        self, queue: str, *, unique_id: str | None = None, correlation_id: str | None = None
    ) -> int:
        """What :meth:`nmbus.Bus.cancel` does, from outside any endpoint; how many."""
        request = Cancel.of(unique_id, correlation_id)
        return await self._ops.cancel(validate_queue_name(queue), request)

    async def run_retention(
        self,
        policy: RetentionPolicy,
        queues: Sequence[str] | None = None,
        on_batch: ProgressCallback | None = None,
    ) -> list[RetentionResult]:
        """Remove (and archive, if the policy says so) old rows: see
        :mod:`nmbus.postgres.retention` (the in-memory store does not archive)."""
        return await self._ops.run_retention(policy, queues, on_batch)

    async def create_queues(self, names: Sequence[str]) -> None:
        """Create the schema if it is missing, and a table for each queue that has none."""
        await self._ops.create_queues([validate_queue_name(n) for n in names])

    async def drop_queues(self, names: Sequence[str]) -> list[str]:
        """Drop queue tables and every message in them; all must exist, or none is dropped."""
        return await self._ops.drop_queues(names)

    async def _in_batches(
        self,
        change: _Change,
        queue: str,
        chosen: FailedFilter,
        on_batch: ProgressCallback | None,
    ) -> int:
        done = 0
        while True:
            changed = await change(queue, chosen, FAILED_BATCH)
            done += changed
            if on_batch is not None:
                on_batch(queue, changed)
            if changed < FAILED_BATCH:
                return done


class _Change(Protocol):
    async def __call__(self, queue: str, chosen: FailedFilter, limit: int) -> int: ...


def _limits() -> ReadLimits:
    # Read at each call, so a test (or a tool) may change the constants of this module.
    return ReadLimits(WINDOW_ROWS, EXACT_COUNT_PAGES, BLOCKED_SHOWN)


def _chosen(
    verb: str,
    queue: str,
    ids: Sequence[int] | None,
    message_type: str | None,
    error_contains: str | None,
    every: bool,
    counted: FailedCount | None,
) -> FailedFilter:
    """The failed messages a change acts on: said which, or every one; bound to a count."""
    max_id, until = _bound(queue, counted)
    error = error_contains or None
    if every == any((ids, message_type, error)):
        raise ConfigurationError(
            f"{verb}: say which failed messages, ids, message_type and/or "
            "error_contains, or every=True"
        )
    return FailedFilter(ids, message_type, error, max_id, until)


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


def _parse_cursor(cursor: str | None) -> tuple[str, int] | None:
    """``queue:id`` as failed_page returns it: the page goes on below that message."""
    if not cursor:
        return None
    queue, _, ident = cursor.rpartition(":")
    if not queue or not ident.isdigit() or len(ident) > 19 or int(ident) > MAX_ID:
        raise ConfigurationError(f"not a page cursor: {cursor[:80]!r}")
    return queue, int(ident)
