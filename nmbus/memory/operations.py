"""The operations port on the in-memory store: what PostgreSQL's ``ops_*`` SQL reads, on dicts.

:class:`MemoryOperations` is a part of :class:`nmbus.testing.MemoryStore`, so
``Admin.over(store)`` runs the operations layer over the same tables a test's
bus uses. It follows ``tests/test_operations_contract.py`` as the PostgreSQL
adapter does. Where PostgreSQL estimates, it counts exactly; it keeps no
sagas, no outbox, no marks of queues a send created and no flow limits, and its
retention never archives (the Parquet archive needs PostgreSQL)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from nmbus.delivery.flow import LimitStatus
from nmbus.errors import ConfigurationError, QueueNotFound
from nmbus.memory.segments import whole_table
from nmbus.names import validate_queue_name
from nmbus.ports.operations import (
    BlockedSequence,
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
    WindowStats,
    window_stats,
)
from nmbus.ports.store import SCHEMA_VERSION
from nmbus.rows import COLUMNS, QueueRow

_TEXTS = {"error": "error_info", "body": "msg_text", "headers": "msg_headers"}


def _now() -> datetime:
    return datetime.now(UTC)


def sequence_heads(table: dict[int, QueueRow]) -> set[int]:
    """Ids of the members that may run: the lowest not in X of each sequence (see `claim`)."""
    seen: set[str] = set()
    heads: set[int] = set()
    for r in sorted(table.values(), key=lambda r: r.id):
        if r.sequence_key is not None and r.subqueue != "X":
            if r.sequence_key not in seen:
                heads.add(r.id)
            seen.add(r.sequence_key)
    return heads


def _percentile(ordered: Sequence[float], share: float) -> float | None:
    """PostgreSQL's percentile_cont over sorted values (None: no values)."""
    if not ordered:
        return None
    at = share * (len(ordered) - 1)
    low, high = math.floor(at), math.ceil(at)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def _latencies(rows: Iterable[QueueRow]) -> list[float]:
    return sorted(
        (r.last_processed - r.retry_time).total_seconds() * 1000
        for r in rows
        if r.last_processed is not None
    )


def _first_line(text: str | None) -> str:
    return (text or "").split("\n", 1)[0]


def _blocked(table: dict[int, QueueRow], now: datetime) -> list[BlockedSequence]:
    """Sequences held back by a head in F, or in R not yet due: F first, then by id."""
    found = []
    for head_id in sequence_heads(table):
        head = table[head_id]
        if head.subqueue == "F" or (head.subqueue == "R" and head.retry_time > now):
            waiting = sum(
                1
                for r in table.values()
                if r.sequence_key == head.sequence_key and r.id > head.id and r.subqueue != "X"
            )
            key = head.sequence_key or ""
            error = _first_line(head.error_info)[:1000]
            found.append(
                BlockedSequence(
                    key, head.id, head.subqueue, head.retry_count, head.retry_time, waiting, error
                )
            )
    return sorted(found, key=lambda b: (b.subqueue != "F", b.blocking_id))


def _window(rows: Sequence[QueueRow], now: datetime, seconds: float, cap: int) -> WindowStats:
    start = now - timedelta(seconds=seconds)
    done = [r for r in rows if r.last_processed is not None and r.last_processed > start]
    newest = sorted(
        (r for r in done if r.subqueue == "X"),
        key=lambda r: r.last_processed or now,
        reverse=True,
    )[:cap]
    since = newest[-1].last_processed if newest else None
    failed = [
        r
        for r in done
        if r.subqueue == "F"
        and (len(newest) < cap or (since is not None and (r.last_processed or now) >= since))
    ]
    ms = _latencies(newest)
    average = sum(ms) / len(ms) if ms else None
    figures = (average, _percentile(ms, 0.5), _percentile(ms, 0.95), _percentile(ms, 0.99))
    return window_stats(seconds, cap, len(newest), min(len(failed), cap), since, now, figures)


def _matches(row: QueueRow, chosen: FailedFilter) -> bool:
    wanted = chosen.error_contains
    error = row.error_info
    return (
        row.subqueue == "F"
        and (chosen.ids is None or row.id in chosen.ids)
        and (chosen.message_type is None or row.label == chosen.message_type)
        and (wanted is None or (error is not None and wanted.lower() in error.lower()))
        and (chosen.max_id is None or row.id <= chosen.max_id)
        and (
            chosen.failed_by is None
            or row.last_processed is None
            or row.last_processed <= chosen.failed_by
        )
    )


class MemoryOperations:
    """The operations port over the in-memory store's tables (a part of MemoryStore)."""

    schema: str
    tables: dict[str, dict[int, QueueRow]]
    subscribed: dict[tuple[str, str, str], datetime | None]
    subscribed_at: dict[tuple[str, str, str], datetime]
    _listeners: list[Callable[[str], None]]

    async def schema_exists(self) -> bool:
        return True

    async def schema_version(self) -> int | None:
        return SCHEMA_VERSION

    async def rows_estimate(self, queues: Sequence[str] | None) -> int:
        return sum(len(self.tables[name]) for name in self._known(queues))

    async def queue_status(
        self,
        windows: Sequence[float],
        exact: bool,
        queues: Sequence[str] | None,
        limits: ReadLimits,
    ) -> list[QueueStatus]:
        return [self._status(name, windows, exact, limits) for name in self._known(queues)]

    async def queue_detail(
        self, queue: str, windows: Sequence[float], limits: ReadLimits
    ) -> QueueStatus:
        return self._status(self._queue(queue), windows, False, limits)

    async def queues_created_by_send(self) -> dict[str, str | None]:
        return {}  # the in-memory store marks no queue

    async def queue_depths(self, limits: ReadLimits) -> list[QueueDepth]:
        found = []
        now = _now()
        for name in self._known(None):
            depth = _depth(self.tables[name], now)
            blocked = min(len(_blocked(self.tables[name], now)), limits.blocked_shown)
            found.append(QueueDepth(name, blocked=blocked, **depth))
        return found

    async def queue_segments(self, queues: Sequence[str] | None) -> list[SegmentInfo]:
        return [whole_table(name, self.tables[name]) for name in self._known(queues)]

    async def flow_status(self, queues: Sequence[str] | None) -> list[LimitStatus]:
        self._known(queues)  # an unknown queue is refused
        return []  # no flow limits here (the docstring above)

    async def queue_history(
        self, queue: str, bucket_seconds: float, buckets: int, cap: int
    ) -> list[HistoryBucket]:
        rows = list(self.tables[self._queue(queue)].values())
        now = _now()
        last = math.floor(now.timestamp() / bucket_seconds)
        found = []
        for k in reversed(range(buckets)):
            start = datetime.fromtimestamp((last - k) * bucket_seconds, UTC)
            end = start + timedelta(seconds=bucket_seconds)
            inside = [
                r for r in rows if r.last_processed is not None and start <= r.last_processed < end
            ]
            ms = _latencies([r for r in inside if r.subqueue == "X"][:cap])
            failed = min(sum(1 for r in inside if r.subqueue == "F"), cap)
            found.append(
                HistoryBucket(
                    start,
                    len(ms),
                    failed,
                    _percentile(ms, 0.5),
                    _percentile(ms, 0.95),
                    _percentile(ms, 0.99),
                )
            )
        return found

    async def failed_messages(
        self, queue: str | None, message_type: str | None, limit: int
    ) -> list[FailedMessage]:
        chosen = FailedFilter(message_type=message_type)
        found: list[FailedMessage] = []
        for name in [self._queue(queue)] if queue else self._known(None):
            rows = sorted(
                (r for r in self.tables[name].values() if _matches(r, chosen)), key=_by_id
            )
            found.extend(_failed(name, r, None) for r in rows[:limit])
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
        chosen = FailedFilter(message_type=message_type, error_contains=error_contains)
        names = [self._queue(queue)] if queue else self._known(None)
        found: list[FailedMessage] = []
        for name in names:
            if after is not None and name < after[0]:
                continue
            below = after[1] if after is not None and name == after[0] else None
            rows = sorted(
                (
                    r
                    for r in self.tables[name].values()
                    if _matches(r, chosen) and (below is None or r.id < below)
                ),
                key=_by_id,
                reverse=True,
            )
            found.extend(_failed(name, r, error_chars) for r in rows[: limit - len(found)])
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
        chosen = FailedFilter(ids, message_type, error_contains)
        matched = [r.id for r in self.tables[self._queue(queue)].values() if _matches(r, chosen)]
        return FailedCount(queue, len(matched), max(matched, default=None), _now())

    async def message(
        self, queue: str, message_id: int, max_chars: int | None
    ) -> MessageRow | None:
        row = self.tables[self._queue(queue)].get(message_id)
        if row is None:
            return None
        values: dict[str, Any] = {name: getattr(row, name) for name in COLUMNS}
        lengths: dict[str, Any] = {}
        for name in ("error_info", "msg_text", "msg_headers"):
            text = values[name]
            lengths[f"{name}_chars"] = len(text or "")
            if text is not None and max_chars is not None:
                values[name] = text[:max_chars]
        return MessageRow(**values, **lengths)

    async def message_text(self, queue: str, message_id: int, part: str) -> str | None:
        row = self.tables[self._queue(queue)].get(message_id)
        if row is None:
            raise QueueNotFound(f"no message {message_id} in queue {queue!r}")
        text: str | None = getattr(row, _TEXTS[part])
        return text

    async def subscriptions(self, publisher: str | None) -> list[Subscription]:
        now = _now()
        found = []
        # Keyed (publisher, type, subscriber): sorted, they are in the order PostgreSQL lists.
        for key, expires in sorted(self.subscribed.items()):
            pub, name, sub = key
            if publisher is None or pub == publisher:
                live = expires is None or expires > now
                since = self.subscribed_at.get(key, now)
                found.append(Subscription(pub, sub, name, since, expires, live))
        return found

    async def outbox_backlog(self) -> list[OutboxBacklog]:
        return []  # the in-memory store has no outbox

    async def probe(self, dsn: str, timeout: float) -> str | None:
        return "the in-memory store reaches no other database"

    async def retention_due(
        self, policy: RetentionPolicy, queues: Sequence[str] | None
    ) -> list[RetentionDue]:
        now = _now()
        found = []
        for name in self._known(queues):
            x = self._old(name, "X", policy.max_age, now)
            f = self._old(name, "F", policy.failed_max_age, now)
            found.append(RetentionDue(name, processed=len(x), failed=len(f)))
        return found

    # -- writes ----------------------------------------------------------------------------

    async def requeue_failed(self, queue: str, chosen: FailedFilter, limit: int) -> int:
        table = self.tables[self._queue(queue)]
        now = _now()
        picked = sorted(r.id for r in table.values() if _matches(r, chosen))[:limit]
        for row_id in picked:
            table[row_id] = replace(
                table[row_id],
                subqueue="I",
                retry_count=0,
                retry_time=now,
                handling_client_id=None,
                lease_expires=None,
            )
        if picked:
            for listener in self._listeners:
                listener(queue)
        return len(picked)

    async def purge_failed(self, queue: str, chosen: FailedFilter, limit: int) -> int:
        table = self.tables[self._queue(queue)]
        picked = sorted(r.id for r in table.values() if _matches(r, chosen))[:limit]
        for row_id in picked:
            del table[row_id]
        return len(picked)

    async def run_retention(
        self,
        policy: RetentionPolicy,
        queues: Sequence[str] | None,
        on_batch: ProgressCallback | None,
    ) -> list[RetentionResult]:
        _refuse_archive(policy)
        return [self.clean_queue(name, policy, on_batch) for name in self._known(queues)]

    def clean_queue(
        self, queue: str, policy: RetentionPolicy, on_batch: ProgressCallback | None = None
    ) -> RetentionResult:
        """Remove the old rows of one queue as PostgreSQL's retention does, in batches."""
        _refuse_archive(policy)
        table = self.tables[self._queue(queue)]
        now = _now()
        result = RetentionResult(queue)
        # I/R rows that expired long ago and no worker took: to X, as retention_expire.
        for row in list(table.values()):
            held = row.lease_expires is not None and row.lease_expires >= now
            gone = row.expires_at is not None and row.expires_at < now - policy.max_age
            if row.subqueue in "IR" and gone and not held:
                error = f"dropped: Expired: {row.label or '?'} expired and no worker took it"
                table[row.id] = replace(
                    row,
                    subqueue="X",
                    last_processed=row.expires_at,
                    error_info=f"{error} (removed by retention)",
                    handling_client_id=None,
                    lease_expires=None,
                )
        for subqueue, age in (("X", policy.max_age), ("F", policy.failed_max_age)):
            old = self._old(queue, subqueue, age, now)
            for start in range(0, len(old), policy.batch_size):
                batch = old[start : start + policy.batch_size]
                for row_id in batch:
                    del table[row_id]
                result.batches += 1
                result.deleted[subqueue] += len(batch)
                if on_batch is not None:
                    on_batch(queue, len(batch))
        return result

    async def create_queues(self, names: Sequence[str]) -> None:
        for name in names:
            self.tables.setdefault(validate_queue_name(name), {})

    async def drop_queues(self, names: Sequence[str]) -> list[str]:
        self._known(names, missing="; nothing dropped")
        for name in names:
            del self.tables[name]
        return list(names)

    # -- plumbing --------------------------------------------------------------------------

    def _queue(self, queue: str) -> str:
        validate_queue_name(queue)
        if queue not in self.tables:
            raise QueueNotFound(f"no queue {queue!r} in schema {self.schema!r}")
        return queue

    def _known(self, wanted: Sequence[str] | None, missing: str = "") -> list[str]:
        """Every queue, or those ``wanted`` if all of them exist."""
        if wanted is None:
            return sorted(self.tables)
        if absent := [q for q in wanted if q not in self.tables]:
            raise QueueNotFound(f"no such queue(s): {', '.join(absent)}{missing}")
        return list(wanted)

    def _old(self, queue: str, subqueue: str, age: timedelta | None, now: datetime) -> list[int]:
        """Ids of ``queue``'s rows of ``subqueue`` last processed more than ``age`` ago."""
        if age is None:
            return []
        return sorted(
            r.id
            for r in self.tables[queue].values()
            if r.subqueue == subqueue and r.last_processed is not None
            and r.last_processed < now - age
        )  # fmt: skip

    def _status(
        self, name: str, windows: Sequence[float], exact: bool, limits: ReadLimits
    ) -> QueueStatus:
        table = self.tables[name]
        rows = list(table.values())
        now = _now()
        stats = tuple(_window(rows, now, w, limits.window_rows) for w in windows)
        recent = _window(rows, now, windows[0], len(rows) + 1) if exact else stats[0]
        return QueueStatus(
            name,
            **_depth(table, now),
            recent_processed=recent.processed,
            recent_avg_ms=recent.avg_ms,
            recent_p99_ms=recent.p99_ms,
            recent_failed=recent.failed,
            blocked=tuple(_blocked(table, now)[: limits.blocked_shown]),
            windows=stats,
        )


def _depth(table: dict[int, QueueRow], now: datetime) -> dict[str, Any]:
    """Rows per subqueue, rows held, and how long the oldest claimable row has waited."""
    rows = table.values()
    heads = sequence_heads(table)
    count = {sq: sum(1 for r in rows if r.subqueue == sq) for sq in "IRXF"}
    waiting = [
        r.retry_time
        for r in rows
        if r.subqueue in "IR"
        and r.retry_time <= now
        and (r.lease_expires is None or r.lease_expires < now)
        and (r.sequence_key is None or r.id in heads)
    ]
    return {
        "ready": count["I"],
        "scheduled": count["R"],
        "processed": count["X"],
        "failed": count["F"],
        "in_flight": sum(1 for r in rows if r.subqueue in "IR" and r.handling_client_id),
        "oldest_ready_seconds": (now - min(waiting)).total_seconds() if waiting else None,
    }


def _by_id(row: QueueRow) -> int:
    return row.id


def _refuse_archive(policy: RetentionPolicy) -> None:
    if policy.archive_dir is not None:
        raise ConfigurationError(
            "the in-memory store cannot archive: retention's Parquet archive "
            "(archive_dir, NMBUS_RETENTION_ARCHIVE_DIR) needs PostgreSQL"
        )


def _failed(queue: str, row: QueueRow, error_chars: int | None) -> FailedMessage:
    line = _first_line(row.error_info)
    cut = error_chars is not None and len(line) > error_chars
    return FailedMessage(
        queue,
        row.id,
        row.label,
        row.retry_count,
        row.insert_time,
        row.last_processed,
        line[:error_chars] if cut else line,
        cut,
    )
