"""The in-memory store: queue tables and subscriptions in dicts, for unit tests.

``MemoryStore`` follows the storage port's contract as the PostgreSQL store does
(``tests/test_store_contract.py`` runs against both), so sending, handling,
publish/subscribe, retries, sagas and shutdown can be tested without a database. It
has no SQL connection: handlers that use ``ctx.connection`` need the real store, and
operations (:class:`nmbus.ops.admin.Admin`, the dashboard) run on PostgreSQL only.
Import it from :mod:`nmbus.testing`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from nmbus.delivery.cancellation import Cancel
from nmbus.delivery.flow import FlowLimits
from nmbus.envelopes import UNIQUE_FOR_HEADER, UNIQUE_WHILE_HEADER
from nmbus.errors import ConfigurationError, QueueNotFound
from nmbus.memory.claims import cancel_rows, claimed_message, recovery, sequence_heads
from nmbus.messages import Envelope, StoredMessage
from nmbus.names import validate_queue_name
from nmbus.ports.operations import RetentionPolicy
from nmbus.ports.store import SCHEMA_VERSION, Outcomes, Readiness, SagaTable
from nmbus.rows import QueueRow
from nmbus.settings import Settings


def _now() -> datetime:
    return datetime.now(UTC)


_LONG_AGO = datetime(1970, 1, 1, tzinfo=UTC)


class MemoryBatch:
    """Changes of one batch, applied together when the batch commits."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self._inserts: list[tuple[str, str, list[Envelope]]] = []
        self.tables_to_create: set[str] = set()
        self._finishes: list[tuple[str, Outcomes, str]] = []

    @property
    def connection(self) -> Any:
        raise ConfigurationError(
            "the in-memory store has no database connection; test handlers that use "
            "ctx.connection against PostgreSQL"
        )

    async def savepoint(self) -> None:
        pass

    async def begin(self) -> None:
        pass

    async def release_savepoint(self) -> None:
        pass

    async def rollback_savepoint(self) -> None:
        pass

    @property
    def begun(self) -> bool:
        return True  # changes wait for the commit, like a transaction's

    def defer_release(self) -> None:
        pass

    async def insert(self, queue: str, from_endpoint: str, envelopes: Sequence[Envelope]) -> int:
        if queue not in self._store.tables:
            self.tables_to_create.add(validate_queue_name(queue))
        self._inserts.append((queue, from_endpoint, list(envelopes)))
        return len(envelopes)

    async def subscribers(self, publisher: str, types: Sequence[str]) -> list[str]:
        return await self._store.subscribers(publisher, types)

    async def publish(
        self, publisher: str, envelopes: Sequence[Envelope], chains: Sequence[str]
    ) -> dict[str, int]:
        copies = self._store._fan_out(publisher, envelopes, chains)
        for queue, batch in copies.items():
            self.tables_to_create.add(queue)
            self._inserts.append((queue, publisher, batch))
        return {queue: len(batch) for queue, batch in copies.items()}

    async def finish(self, queue: str, outcomes: Outcomes, claim: str) -> int:
        table = self._store._require(queue)
        leased = sum(1 for i in outcomes.ids if table[i].handling_client_id == claim)
        self._finishes.append((queue, outcomes, claim))
        return leased

    async def finish_and_claim(
        self, queue: str, outcomes: Outcomes, claim: str, limit: int, lease: float, next_claim: str
    ) -> tuple[int, list[StoredMessage]]:
        # Nothing is claimed ahead: the next claim comes after the commit.
        return await self.finish(queue, outcomes, claim), []

    async def commit(self) -> None:
        self._commit()

    def _commit(self) -> None:
        for queue in self.tables_to_create:
            self._store.tables.setdefault(queue, {})
        for queue, from_endpoint, envelopes in self._inserts:
            self._store._insert_now(queue, from_endpoint, envelopes)
        for queue, outcomes, claim in self._finishes:
            self._store._finish_now(queue, outcomes, claim)
        self.tables_to_create, self._inserts, self._finishes = set(), [], []


class MemorySession:
    recheck: float | None = None  # no flow limits here

    def __init__(self, store: MemoryStore) -> None:
        self._store = store

    async def claim(self, queue: str, limit: int, claim: str, lease: float) -> list[StoredMessage]:
        now = _now()
        table = self._store._require(queue)
        heads = sequence_heads(table)
        ready = sorted(
            (
                r
                for r in table.values()
                if r.subqueue in "IR"
                and r.retry_time <= now
                and (r.lease_expires is None or r.lease_expires < now)
                and (r.sequence_key is None or r.id in heads)
            ),
            key=lambda r: (-r.priority, r.retry_time, r.id),
        )[:limit]
        claimed = []
        for held in ready:
            row = table[held.id] = replace(
                held,
                retry_count=min(held.retry_count, 2**31 - 2) + 1,
                isolated=False,
                handling_client_id=claim,
                lease_expires=now + timedelta(seconds=lease),
            )
            claimed.append(claimed_message(row, recovery(held), now))
        return claimed

    async def next_due(self, queue: str) -> float | None:
        now = _now()
        future = [
            r.retry_time
            for r in self._store._require(queue).values()
            if r.subqueue in "IR" and r.retry_time > now
        ]
        return (min(future) - now).total_seconds() if future else None

    async def release_sequences(self, queue: str) -> int:
        return 0  # the in-memory claim finds sequence heads itself: nothing is parked

    async def isolate(
        self,
        queue: str,
        ids: Sequence[int],
        suspect: int,
        marks: Sequence[bool],
        claim: str,
        refunds: Sequence[int],
    ) -> int:
        table = self._store._require(queue)
        changed = 0
        for row_id, mark, refund in zip(ids, marks, refunds, strict=True):
            row = table.get(row_id)
            if row is None or row.handling_client_id != claim:
                continue
            changed += 1
            if row_id == suspect:
                table[row_id] = replace(row, isolated=True)
            else:
                table[row_id] = replace(
                    row,
                    isolated=False,
                    retry_count=max(0, row.retry_count - refund),
                    handling_client_id=None,
                    lease_expires=_LONG_AGO if mark else None,
                )
        return changed

    @asynccontextmanager
    async def batch(self) -> AsyncIterator[MemoryBatch]:
        batch = MemoryBatch(self._store)
        yield batch
        batch._commit()


class MemoryStore:
    """Queue tables and subscriptions in a dict, for application tests.

    It implements the storage port: sending, handling, publish/subscribe,
    retries, sagas and their timeouts run on it as on PostgreSQL (one contract
    suite, tests/test_store_contract.py). Operations (Admin, the dashboard, the
    command line) run on PostgreSQL only.
    """

    #: Flow limits (nmbus/delivery/flow.py) need PostgreSQL's claim: a worker refuses to start.
    flow_limits = False

    def __init__(self, schema: str = "nmbus") -> None:
        self.schema = schema
        self.tables: dict[str, dict[int, QueueRow]] = {}
        # (publisher, type, subscriber) -> when it expires (None: never), and since when.
        self.subscribed: dict[tuple[str, str, str], datetime | None] = {}
        self.subscribed_at: dict[tuple[str, str, str], datetime] = {}
        self._ids = itertools.count(1)
        self._listeners: list[Callable[[str], None]] = []
        # The latest due time enqueued per (queue, schedule): never removed.
        self.ticks: dict[tuple[str, str], datetime] = {}

    def _require(self, queue: str) -> dict[int, QueueRow]:
        table = self.tables.get(queue)
        if table is None:
            raise QueueNotFound(f"queue {queue!r} does not exist")
        return table

    def rows(self, queue: str) -> list[QueueRow]:
        """A copy of every row of ``queue``, by id."""
        return [replace(r) for _, r in sorted(self._require(queue).items())]

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def ensure_queue(self, queue: str) -> None:
        self.tables.setdefault(validate_queue_name(queue), {})

    async def ensure_sagas(self, endpoint: str) -> None:
        raise ConfigurationError(
            "the in-memory store keeps no saga state: test sagas against PostgreSQL"
        )

    def saga_table(self, endpoint: str) -> SagaTable:
        raise ConfigurationError(
            "the in-memory store keeps no saga state: test sagas against PostgreSQL"
        )

    async def drop_queue(self, queue: str) -> None:
        self.tables.pop(validate_queue_name(queue), None)

    async def list_queues(self) -> list[str]:
        return sorted(self.tables)

    async def readiness(self, queue: str) -> Readiness:
        return Readiness(SCHEMA_VERSION, queue in self.tables)

    async def insert(
        self,
        queue: str,
        from_endpoint: str,
        envelopes: Sequence[Envelope],
        connection: Any = None,
    ) -> int:
        if connection is not None:
            raise ConfigurationError("the in-memory store cannot send inside a connection")
        await self.ensure_queue(queue)
        return self._insert_now(queue, from_endpoint, envelopes)

    async def insert_tick(
        self, queue: str, schedule: str, due: datetime, envelope: Envelope
    ) -> bool:
        await self.ensure_queue(queue)
        last = self.ticks.get((queue, schedule))
        # As PostgreSQL's: a record over a minute ahead of the clock is not trusted.
        if last is not None and last >= due and last <= _now() + timedelta(minutes=1):
            return False
        self.ticks[(queue, schedule)] = due
        return bool(self._insert_now(queue, queue, [envelope]))

    def _insert_now(
        self, queue: str, from_endpoint: str, envelopes: Sequence[Envelope], create: bool = False
    ) -> int:
        if create:
            self.tables.setdefault(queue, {})
        table = self._require(queue)
        now = _now()
        seen = {r.unique_id for r in table.values() if _holds_unique(r, now)}
        inserted = 0
        for e in envelopes:
            if e.unique_id in seen:
                continue
            seen.add(e.unique_id)
            scheduled = e.deliver_at is not None and e.deliver_at > now
            row_id = next(self._ids)
            table[row_id] = QueueRow(
                id=row_id,
                from_endpoint=from_endpoint,
                to_endpoint=queue,
                subqueue="R" if scheduled else "I",
                insert_time=now,
                last_processed=None,
                retry_count=0,
                retry_time=e.deliver_at if scheduled and e.deliver_at else now,
                error_info=None,
                correlation_id=e.correlation_id,
                label=e.label,
                msg_text=e.msg_text,
                msg_headers=e.msg_headers,
                unique_id=e.unique_id,
                priority=e.priority,
                sequence_key=e.sequence,
                expires_at=e.expires_at,
            )
            inserted += 1
        for listener in self._listeners:
            listener(queue)
        return inserted

    def _finish_now(self, queue: str, outcomes: Outcomes, claim: str) -> None:
        table = self._require(queue)
        now = _now()
        for i, row_id in enumerate(outcomes.ids):
            row = table[row_id]
            if row.handling_client_id != claim:
                continue
            subqueue = outcomes.subqueue[i]
            if subqueue is not None:
                retry_time = row.retry_time
                if subqueue == "R":
                    retry_time = now + timedelta(seconds=outcomes.delay[i] or 0.0)
                row = replace(row, subqueue=subqueue, last_processed=now, retry_time=retry_time)
            error = outcomes.error_info[i]
            table[row_id] = replace(
                row,
                error_info=row.error_info if error is None else error,
                retry_count=max(0, row.retry_count + outcomes.correction[i]),
                handling_client_id=None,
                lease_expires=None,
            )

    async def subscribe(
        self,
        publisher: str,
        subscriber: str,
        types: Sequence[str],
        ttl: float | None,
        remote: bool = False,
    ) -> None:
        now = _now()
        expires = now + timedelta(seconds=ttl) if ttl is not None else None
        for name in types:
            self.subscribed[(publisher, name, subscriber)] = expires
            self.subscribed_at.setdefault((publisher, name, subscriber), now)

    async def unsubscribe(self, publisher: str, subscriber: str, types: Sequence[str]) -> None:
        for name in types:
            self.subscribed.pop((publisher, name, subscriber), None)
            self.subscribed_at.pop((publisher, name, subscriber), None)

    async def subscribers(
        self, publisher: str, types: Sequence[str], connection: Any = None
    ) -> list[str]:
        now = _now()
        return sorted(
            {
                sub
                for (pub, name, sub), expires in self.subscribed.items()
                if pub == publisher and name in types and (expires is None or expires > now)
            }
        )

    def _fan_out(
        self, publisher: str, envelopes: Sequence[Envelope], chains: Sequence[str]
    ) -> dict[str, list[Envelope]]:
        now = _now()
        wanted: dict[str, set[str]] = {}
        for (pub, name, sub), expires in self.subscribed.items():
            if pub == publisher and (expires is None or expires > now):
                wanted.setdefault(sub, set()).add(name)
        copies: dict[str, list[Envelope]] = {}
        for sub in sorted(wanted):
            copies[sub] = [
                replace(e, unique_id=f"{e.unique_id}/{sub}")
                for e, chain in zip(envelopes, chains, strict=True)
                if wanted[sub].intersection(chain.split(","))
            ]
            if not copies[sub]:
                del copies[sub]
        return copies

    async def publish(
        self,
        publisher: str,
        envelopes: Sequence[Envelope],
        chains: Sequence[str],
        connection: Any = None,
    ) -> dict[str, int]:
        if connection is not None:
            raise ConfigurationError("the in-memory store cannot publish inside a connection")
        return {
            queue: self._insert_now(queue, publisher, batch, create=True)
            for queue, batch in self._fan_out(publisher, envelopes, chains).items()
        }

    async def purge_expired_subscriptions(self, grace: float) -> int:
        cutoff = _now() - timedelta(seconds=grace)
        expired = [k for k, v in self.subscribed.items() if v is not None and v < cutoff]
        for key in expired:
            del self.subscribed[key]
            self.subscribed_at.pop(key, None)
        return len(expired)

    async def has_ready(self, queue: str) -> bool:
        now = _now()
        heads = sequence_heads(self._require(queue))
        return any(
            r.subqueue in "IR"
            and (r.retry_time <= now or r.handling_client_id is not None)
            and (r.sequence_key is None or r.id in heads)
            for r in self._require(queue).values()
        )

    async def apply_retention(self, queue: str, settings: Settings) -> None:
        """Remove the old rows of ``queue`` as PostgreSQL's retention does (no archive)."""
        policy = RetentionPolicy.from_settings(settings)
        if policy.archive_dir is not None:
            raise ConfigurationError(
                "the in-memory store cannot archive: retention's Parquet archive "
                "(archive_dir, NMBUS_RETENTION_ARCHIVE_DIR) needs PostgreSQL"
            )
        table, now = self._require(queue), _now()
        for row in list(table.values()):
            # I/R rows that expired long ago and no worker took: to X, as retention_expire.
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
            if age is None:
                continue
            for row in list(table.values()):
                done = row.last_processed is not None and row.last_processed < now - age
                if row.subqueue == subqueue and done:
                    del table[row.id]

    async def flow_started(self, queue: str, starts: Sequence[tuple[str, int, int, str]]) -> None:
        raise ConfigurationError("flow limits need PostgreSQL")  # a worker refuses to start

    async def cancel(self, queue: str, request: Cancel) -> int:
        return cancel_rows(self._require(queue), request)

    async def counts(self, queue: str) -> dict[str, int]:
        counts = dict.fromkeys("IRXF", 0)
        for row in self._require(queue).values():
            counts[row.subqueue] += 1
        return counts

    async def renew_leases(
        self, queue: str, ids: Sequence[int], claims: Sequence[str], lease: float
    ) -> set[int]:
        table, renewed = self._require(queue), set()
        for i, claim in zip(ids, claims, strict=True):
            if i in table and table[i].handling_client_id == claim:
                table[i] = replace(table[i], lease_expires=_now() + timedelta(seconds=lease))
                renewed.add(i)
        return renewed

    async def abandon_leases(
        self,
        queue: str,
        ids: Sequence[int],
        claim: str,
        refund: bool = False,
        suspects: Collection[int] = (),
    ) -> None:
        self._free(queue, ids, [None] * len(ids), claim, int(refund), suspects)

    async def give_back(
        self, queue: str, ids: Sequence[int], attempts: Sequence[int], claim: str
    ) -> list[int]:
        return self._free(queue, ids, attempts, claim, 1)

    def _free(
        self,
        queue: str,
        ids: Sequence[int],
        at: Sequence[int | None],
        claim: str,
        refund: int,
        suspects: Collection[int] = (),
    ) -> list[int]:
        """Free rows ``ids`` leased by ``claim`` (at attempts ``at``, where given)."""
        table, freed = self._require(queue), []
        for i, attempt in zip(ids, at, strict=True):
            row = table.get(i)
            if row and row.handling_client_id == claim and attempt in (None, row.retry_count):
                n = max(0, row.retry_count - refund)
                # A suspect's mark is a lease that ran out long ago (as isolate leaves it).
                lease = _LONG_AGO if i in suspects else None
                table[i] = replace(row, handling_client_id=None, lease_expires=lease, retry_count=n)
                freed.append(i)
        return freed

    @asynccontextmanager
    async def worker_session(
        self, flow: FlowLimits | None = None, idle: float | None = None
    ) -> AsyncIterator[MemorySession]:
        if flow is not None:
            raise ConfigurationError(
                "flow limits (concurrency=, rate=, group_concurrency=) are enforced by "
                "PostgreSQL's claim; the in-memory store has none: test them on PostgreSQL"
            )
        yield MemorySession(self)

    async def listen(self, on_wakeup: Callable[[str], None], reconnect_max: float = 10.0) -> None:
        self._listeners.append(on_wakeup)
        try:
            await asyncio.Event().wait()
        finally:
            self._listeners.remove(on_wakeup)


def _holds_unique(row: QueueRow, now: datetime) -> bool:
    """Whether the row still holds its unique_id: always, or within its window
    (docs/messages.md, "Unique windows"), as the queue's unique table says."""
    text = row.msg_headers
    if not text or "nmbus-unique-" not in text:
        return True
    headers = json.loads(text)
    seconds = headers.get(UNIQUE_FOR_HEADER)
    if seconds is not None:
        return now < row.insert_time + timedelta(seconds=float(seconds))
    if UNIQUE_WHILE_HEADER in headers:
        return row.subqueue in ("I", "R")
    return True
