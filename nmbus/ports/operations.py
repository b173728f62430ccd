"""The operations port: what an operator's tools need from a store.

:class:`nmbus.ops.admin.Admin` (behind the CLI and the dashboard) checks its
arguments and pages, binds changes to counts, and calls these methods; a store
answers them. PostgreSQL's adapter implements it
(:class:`nmbus.postgres.operations.PostgresOperations`), with its contract suite
``tests/test_operations_contract.py``; operations run on PostgreSQL only (the
in-memory store is the store of application tests: it keeps no copy of the
operations SQL).

Results are typed (the dataclasses below; ``nmbus.ops.admin`` exports them too).
Methods that read never create anything: a queue that has no table raises
QueueNotFound. Methods that write say so in their name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Protocol

# Re-exported: the operator's layer speaks of retention too.
from nmbus.delivery.flow import LimitStatus as LimitStatus
from nmbus.ports.retention import ProgressCallback as ProgressCallback
from nmbus.ports.retention import RetentionPolicy as RetentionPolicy
from nmbus.ports.retention import RetentionResult as RetentionResult
from nmbus.ports.store import Readiness as Readiness
from nmbus.rows import QueueRow

if TYPE_CHECKING:
    from nmbus.delivery.cancellation import Cancel


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
class SegmentInfo:
    """One segment (partition) of a queue table; a table not partitioned is one, number 0."""

    queue: str
    name: str  # its table: "<queue>$s<n>", or the queue table itself when not partitioned
    number: int  # n: newer segments have higher numbers
    rows: int  # estimated (the planner's or the statistics system's count), never counted
    pending: int  # rows not in X, counted exactly through the partial indexes
    oldest: datetime | None  # insert_time of its lowest id (None: empty)
    newest: datetime | None  # insert_time of its highest id
    size_bytes: int  # table, indexes and TOAST (0 in memory)


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
class MessageRow(QueueRow):
    """Every column of one row of a queue table (:class:`nmbus.rows.QueueRow`); the
    headers as JSON text.

    Read with ``max_chars``, error_info, msg_text and msg_headers are cut at
    that many characters; the ``*_chars`` fields give their whole lengths.
    """

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


def window_stats(
    seconds: float,
    cap: int,
    processed: int,
    failed: int,
    since: datetime | None,
    now: datetime,
    latencies: tuple[float | None, float | None, float | None, float | None],
) -> WindowStats:
    """A window's figures from what was read: ``processed`` newest X rows (at most
    ``cap``), the oldest ``last_processed`` among them (``since``), the F rows over
    the same span, and the latency average, p50, p95 and p99 in ms."""
    sampled = processed >= cap
    span = seconds
    if sampled and since is not None:
        span = max((now - since).total_seconds(), 1e-3)
    avg_ms, p50_ms, p95_ms, p99_ms = latencies
    return WindowStats(
        seconds=seconds,
        processed=processed,
        failed=failed,
        per_second=processed / span,
        avg_ms=avg_ms,
        p50_ms=p50_ms,
        p95_ms=p95_ms,
        p99_ms=p99_ms,
        sampled=sampled,
    )


@dataclass(frozen=True, slots=True)
class ReadLimits:
    """How much one read may cost; :mod:`nmbus.ops.admin` says how much (its constants)."""

    window_rows: int  # a window reads at most this many newest X rows (and F rows)
    exact_count_pages: int  # tables of at most this many pages have X counted exactly
    blocked_shown: int  # blocked sequences listed (or counted) per queue


@dataclass(frozen=True, slots=True)
class FailedFilter:
    """Which failed messages of a queue: each condition None matches any.

    ``error_contains`` is plain text found in error_info in any case; ``max_id``
    and ``failed_by`` bind a change to what a FailedCount counted (rows up to
    that id, that failed by that time).
    """

    ids: Sequence[int] | None = None
    message_type: str | None = None
    error_contains: str | None = None
    max_id: int | None = None
    failed_by: datetime | None = None


class Operations(Protocol):
    """The queries and actions of an operator on one store (one nmbus schema).

    Every read is one consistent look where the store can give one (on
    PostgreSQL: one read-only transaction) and raises QueueNotFound when the
    schema or a queue named is missing. ``queues`` None means every queue.
    """

    schema: str

    async def close(self) -> None: ...

    async def schema_exists(self) -> bool:
        """Whether the store holds this nmbus schema (none is made when it does not)."""
        ...

    async def schema_version(self) -> int | None:
        """The schema's version (nmbus.ports.store.SCHEMA_VERSION); None: it has none yet."""
        ...

    async def list_queues(self) -> list[str]:
        """Names of every queue that has a table, sorted."""
        ...

    async def readiness(self, queue: str) -> Readiness:
        """The schema's version (None: no schema) and whether ``queue`` has its table."""
        ...

    async def rows_estimate(self, queues: Sequence[str] | None) -> int:
        """Rows in the queues' tables, estimated without a scan where the store can."""
        ...

    async def queue_status(
        self,
        windows: Sequence[float],
        exact: bool,
        queues: Sequence[str] | None,
        limits: ReadLimits,
    ) -> list[QueueStatus]:
        """Each queue (in the order of ``queues``); ``recent_*`` cover ``windows[0]``.

        ``exact``: X counted row by row, whatever the table's size.
        """
        ...

    async def queue_detail(
        self, queue: str, windows: Sequence[float], limits: ReadLimits
    ) -> QueueStatus:
        """One queue's status (as queue_status, not exact), with these windows."""
        ...

    async def queues_created_by_send(self) -> dict[str, str | None]:
        """Queues a send created that no endpoint has started on, with their first sender."""
        ...

    async def queue_depths(self, limits: ReadLimits) -> list[QueueDepth]:
        """Every queue's depths, by name."""
        ...

    async def queue_segments(self, queues: Sequence[str] | None) -> list[SegmentInfo]:
        """Each queue's segments (by queue, then number), never a scan of X rows."""
        ...

    async def flow_status(self, queues: Sequence[str] | None) -> list[LimitStatus]:
        """Each limited handler of the queues (every queue: None), as last declared, and
        what its limits hold back now (by queue, then handler)."""
        ...

    async def queue_history(
        self, queue: str, bucket_seconds: float, buckets: int, cap: int
    ) -> list[HistoryBucket]:
        """The last ``buckets`` buckets, oldest first, ending with the one now is in."""
        ...

    async def failed_messages(
        self, queue: str | None, message_type: str | None, limit: int
    ) -> list[FailedMessage]:
        """Failed messages of each queue (by name), oldest first, ``limit`` per queue."""
        ...

    async def failed_page(
        self,
        queue: str | None,
        after: tuple[str, int] | None,
        message_type: str | None,
        error_contains: str | None,
        limit: int,
        error_chars: int,
    ) -> list[FailedMessage]:
        """At most ``limit`` failed messages: queues by name, newest first in each.

        ``after`` is (queue, id): start at that queue, below that id. Each error
        line is cut at ``error_chars`` characters.
        """
        ...

    async def failed_count(
        self,
        queue: str,
        ids: Sequence[int] | None,
        message_type: str | None,
        error_contains: str | None,
    ) -> FailedCount:
        """How many failed messages of ``queue`` match, the highest id, and when counted."""
        ...

    async def message(
        self, queue: str, message_id: int, max_chars: int | None
    ) -> MessageRow | None:
        """Every column of one message, whatever its subqueue (None: no such message)."""
        ...

    async def message_text(self, queue: str, message_id: int, part: str) -> str | None:
        """One whole text ("error", "body" or "headers"); QueueNotFound: no such message."""
        ...

    async def subscriptions(self, publisher: str | None) -> list[Subscription]:
        """Every subscription (of ``publisher`` only, if given), expired ones too."""
        ...

    async def outbox_backlog(self) -> list[OutboxBacklog]:
        """What waits in the outbox, per destination queue."""
        ...

    async def probe(self, dsn: str, timeout: float) -> str | None:
        """Why the database at ``dsn`` cannot be used now (one line, no password), or None."""
        ...

    async def retention_due(
        self, policy: RetentionPolicy, queues: Sequence[str] | None
    ) -> list[RetentionDue]:
        """What run_retention would remove now."""
        ...

    async def requeue_failed(self, queue: str, chosen: FailedFilter, limit: int) -> int:
        """Move up to ``limit`` matching failed messages back to I, lowest id first, as fresh
        messages (attempts 0, ready now, no lease; error_info kept), and wake the queue's
        workers. Returns how many moved."""
        ...

    async def purge_failed(self, queue: str, chosen: FailedFilter, limit: int) -> int:
        """Delete up to ``limit`` matching failed messages, lowest id first; how many."""
        ...

    async def cancel(self, queue: str, request: Cancel) -> int:
        """Move the messages ``request`` names that no worker holds to F (Cancelled); how many."""
        ...

    async def run_retention(
        self,
        policy: RetentionPolicy,
        queues: Sequence[str] | None,
        on_batch: ProgressCallback | None,
    ) -> list[RetentionResult]:
        """Remove (and archive, if the policy says so and the store can) old rows."""
        ...

    async def create_queues(self, names: Sequence[str]) -> None:
        """Create the schema if it is missing, and a table for each queue that has none."""
        ...

    async def drop_queues(self, names: Sequence[str]) -> list[str]:
        """Drop queue tables; all must exist (QueueNotFound), or none is dropped."""
        ...
