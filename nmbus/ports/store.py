"""The storage port: what the bus and the worker need from a queue store.

Two adapters implement it: :class:`nmbus.postgres.PostgresStore` (the real
one) and :class:`nmbus.testing.MemoryStore` (for unit tests). One contract
suite, ``tests/test_store_contract.py``, runs against both.

Where a message is, by subqueue: ``I`` ready, ``R`` scheduled (deferred or
retry at ``retry_time``), ``X`` processed, ``F`` failed. A row being handled
stays in I or R with ``handling_client_id`` (the token of the claim that took
it, nmbus/consume/claim.py) and ``lease_expires`` set.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from nmbus.messages import Envelope, StoredMessage

# The name rules live in nmbus.names; importable from here as before.
from nmbus.names import MAX_QUEUE_NAME as MAX_QUEUE_NAME
from nmbus.names import RESERVED_NAMES as RESERVED_NAMES
from nmbus.names import validate_queue_name as validate_queue_name
from nmbus.names import validate_schema_name as validate_schema_name

if TYPE_CHECKING:
    from nmbus.delivery.cancellation import Cancel
    from nmbus.delivery.flow import FlowLimits, LimitStatus
    from nmbus.settings import Settings

SCHEMA_VERSION = 16


@dataclass(frozen=True)
class Readiness:
    """What a readiness check finds in the database (``/readyz``, ``nmbus health``).

    ``schema_version``: the nmbus schema's version, None when the database has
    no such schema; ``queue_exists``: whether the queue asked about has its table.
    """

    schema_version: int | None
    queue_exists: bool

    def problem(self, schema: str, queue: str) -> str | None:
        """Why a process of ``queue`` cannot work on this database, on one line; None: it can."""
        version = self.schema_version
        if version is None:
            return f"no nmbus schema {schema!r} in this database"
        if version > SCHEMA_VERSION:
            return (
                f"schema {schema!r} is at version {version}, newer than this nmbus "
                f"understands ({SCHEMA_VERSION}): upgrade nmbus"
            )
        if version < SCHEMA_VERSION:
            return (
                f"schema {schema!r} is at version {version}, older than this nmbus "
                f"expects ({SCHEMA_VERSION}): a starting Bus migrates it"
            )
        if not self.queue_exists:
            return f"no queue {queue!r} in schema {schema!r}"
        return None


class Outcomes:
    """What became of each message of a claimed batch, as parallel lists.

    ``subqueue`` is X, R, F, or None to release the row unchanged;
    ``correction`` is -1 where the attempt must not count (RetryLater, or a
    message never started because the worker is stopping). While every message
    is simply processed (``all_processed``), only ``ids`` grows: the other
    lists are filled in when first read or when another outcome is added.
    """

    __slots__ = ("_correction", "_delay", "_error_info", "_subqueue", "all_processed", "ids")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self._subqueue: list[str | None] = []
        self._delay: list[float | None] = []
        self._error_info: list[str | None] = []
        self._correction: list[int] = []
        # True while every message so far was simply processed (X, no error, counted).
        self.all_processed = True

    def _fill(self) -> None:
        missing = len(self.ids) - len(self._subqueue)
        if missing:
            self._subqueue.extend(["X"] * missing)
            self._delay.extend([None] * missing)
            self._error_info.extend([None] * missing)
            self._correction.extend([0] * missing)

    @property
    def subqueue(self) -> list[str | None]:
        self._fill()
        return self._subqueue

    @property
    def delay(self) -> list[float | None]:
        self._fill()
        return self._delay

    @property
    def error_info(self) -> list[str | None]:
        self._fill()
        return self._error_info

    @property
    def correction(self) -> list[int]:
        self._fill()
        return self._correction

    def processed(self, id: int) -> None:
        """Message ``id`` was handled: X, no error, its attempt counted."""
        self.ids.append(id)
        if not self.all_processed:
            self._subqueue.append("X")
            self._delay.append(None)
            self._error_info.append(None)
            self._correction.append(0)

    def add(
        self,
        id: int,
        subqueue: str | None,
        delay: float | None = None,
        error_info: str | None = None,
        correction: int = 0,
    ) -> None:
        if subqueue != "X" or error_info is not None or correction:
            self.all_processed = False
        self._fill()
        self.ids.append(id)
        self._subqueue.append(subqueue)
        self._delay.append(delay)
        self._error_info.append(error_info)
        self._correction.append(correction)

    def __len__(self) -> int:
        return len(self.ids)

    def take(self) -> Outcomes:
        """Move every outcome added so far to a new Outcomes (to commit them), leaving none."""
        part = Outcomes()
        part.ids, self.ids = self.ids, []
        part._subqueue, self._subqueue = self._subqueue, []
        part._delay, self._delay = self._delay, []
        part._error_info, self._error_info = self._error_info, []
        part._correction, self._correction = self._correction, []
        part.all_processed, self.all_processed = self.all_processed, True
        return part


SagaKey = tuple[str, str]
"""A saga's name and key: one row of an endpoint's saga table."""


@dataclass(slots=True)
class SagaRow:
    """A saga's row as a batch read it, locked.

    ``state`` is the JSON of the state model; ``version`` counts saves;
    ``instance`` names this life of the saga (None for a row created before
    schema version 8 and not saved since: its next save sets one).
    """

    state: str | None
    version: int
    instance: str | None = None


@dataclass(slots=True)
class SagaSave:
    """A saga's state to store: ``saves`` handled messages saved it since its last write."""

    saga: str
    key: str
    state: str
    instance: str
    saves: int


class SagaTable(Protocol):
    """One endpoint's saga states: one row per (saga name, key).

    A batch locks the sagas its messages name before its handlers run
    (``try_lock_keys``, or ``lock_keys`` while it holds none), reads their rows
    (``lock_rows``), and writes what its handlers made of them before it commits
    (``write``), all on the batch's connection ``conn``, in its transaction.
    """

    async def lock_keys(self, conn: Any, keys: Iterable[SagaKey]) -> None:
        """Lock the sagas until the transaction ends, waiting, in one fixed order.

        Whether the sagas exist or not. Two transactions that take their locks
        here never wait for each other in a cycle, as long as neither holds a
        saga lock already.
        """
        ...

    async def try_lock_keys(self, conn: Any, keys: Iterable[SagaKey]) -> set[SagaKey]:
        """Lock the sagas that no other transaction holds, without waiting; those taken."""
        ...

    async def lock_rows(self, conn: Any, keys: Iterable[SagaKey]) -> dict[SagaKey, SagaRow]:
        """The rows of sagas this transaction holds the locks of (missing: no saga)."""
        ...

    async def write(self, conn: Any, saves: Sequence[SagaSave], deletes: Sequence[SagaKey]) -> None:
        """Delete the rows ``deletes``, then store ``saves`` (inserted or updated)."""
        ...

    async def load(self, saga: str, key: str) -> str | None:
        """The committed state of a saga (no lock), None when there is none."""
        ...


class HandlerTransaction(Protocol):
    """The batch's transaction as a handler's Context sees it."""

    @property
    def connection(self) -> Any: ...

    async def savepoint(self) -> None:
        """Take the handler's savepoint (beginning the transaction if needed)."""
        ...


class Batch(HandlerTransaction, Protocol):
    """One transaction over a claimed batch, on the worker's connection.

    The transaction may begin lazily, with the first write: until then
    ``begun`` is False and ``finish`` commits by itself.
    """

    @property
    def begun(self) -> bool: ...

    async def begin(self) -> None:
        """Begin the transaction now if it has not begun, without a savepoint."""
        ...

    async def release_savepoint(self) -> None: ...

    def defer_release(self) -> None:
        """Leave a succeeded handler's savepoint to the next savepoint or the commit.

        Only for a savepoint whose statements all succeeded: one that may be
        aborted must be released at once, so its handler is the one that fails.
        """
        ...

    async def rollback_savepoint(self) -> None: ...

    async def commit(self) -> None:
        """Commit what was written so far, if anything; the next write begins a new transaction.

        Only between handlers: no handler's savepoint may be open.
        """
        ...

    async def insert(self, queue: str, from_endpoint: str, envelopes: Sequence[Envelope]) -> int:
        """Insert into ``queue`` in this transaction, creating its table here if missing."""
        ...

    async def subscribers(self, publisher: str, types: Sequence[str]) -> list[str]: ...

    async def publish(
        self, publisher: str, envelopes: Sequence[Envelope], chains: Sequence[str]
    ) -> dict[str, int]:
        """Copy each envelope into the queue of every live subscriber of its type chain.

        ``chains[i]`` is envelope i's type chain, comma-separated, most specific
        first; each copy's unique_id is ``<envelope unique_id>/<subscriber>``.
        Returns copies inserted per subscriber (0 where all were already there).
        """
        ...

    async def finish(self, queue: str, outcomes: Outcomes, claim: str) -> int:
        """Record ``outcomes`` of rows still leased by ``claim``; returns how many changed."""
        ...

    async def finish_and_claim(
        self, queue: str, outcomes: Outcomes, claim: str, limit: int, lease: float, next_claim: str
    ) -> tuple[int, list[StoredMessage]]:
        """``finish``, and claim up to ``limit`` more rows as ``next_claim``, at once.

        A store that cannot do both in one statement may claim nothing.
        """
        ...


class WorkerSession(Protocol):
    """A worker loop's own connection."""

    #: Seconds after which the loop claims again though nothing woke it (the last
    #: claim held limited messages back), or None.
    recheck: float | None

    async def claim(self, queue: str, limit: int, claim: str, lease: float) -> list[StoredMessage]:
        """Lease up to ``limit`` ready rows to ``claim`` (a token no other claim uses)."""
        ...

    async def next_due(self, queue: str) -> float | None:
        """Seconds until the earliest scheduled row is due, None when none is."""
        ...

    async def release_sequences(self, queue: str) -> int:
        """Make due any sequence head left parked (see insert_messages); how many."""
        ...

    async def isolate(
        self,
        queue: str,
        ids: Sequence[int],
        suspect: int,
        marks: Sequence[bool],
        claim: str,
        refunds: Sequence[int],
    ) -> int:
        """After a crash: keep ``suspect`` alone (marked isolated), let the rest go.

        Committed at once. ``refunds[i]`` attempts are given back to row
        ``ids[i]`` when it is let go; ``marks[i]`` keeps it recognisable as one
        still to be tried alone. Returns how many rows changed.
        """
        ...

    def batch(self) -> AbstractAsyncContextManager[Batch]: ...


class Store(Protocol):
    """A place for queue tables and subscriptions."""

    schema: str

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def ensure_queue(self, queue: str) -> None: ...

    async def ensure_sagas(self, endpoint: str) -> None:
        """Create the saga table of ``endpoint`` when missing (idempotent)."""
        ...

    def saga_table(self, endpoint: str) -> SagaTable: ...

    async def drop_queue(self, queue: str) -> None: ...

    async def list_queues(self) -> list[str]: ...

    async def readiness(self, queue: str) -> Readiness:
        """The schema's version and whether ``queue`` has its table (one read, nothing made)."""
        ...

    async def insert(
        self,
        queue: str,
        from_endpoint: str,
        envelopes: Sequence[Envelope],
        connection: Any = None,
    ) -> int: ...

    async def insert_tick(
        self, queue: str, schedule: str, due: datetime, envelope: Envelope
    ) -> bool:
        """Insert the tick of ``schedule`` due at ``due`` into ``queue`` (the endpoint's own).

        Only when no tick of that schedule due at ``due`` or later was inserted
        before; records ``due`` durably in the same transaction, in a record
        retention never removes. False when the tick was already there.
        """
        ...

    async def subscribe(
        self,
        publisher: str,
        subscriber: str,
        types: Sequence[str],
        ttl: float | None,
        remote: bool = False,
    ) -> None:
        """Write or renew the rows; ``remote``: the subscriber lives in another database."""
        ...

    async def unsubscribe(self, publisher: str, subscriber: str, types: Sequence[str]) -> None: ...

    async def subscribers(
        self, publisher: str, types: Sequence[str], connection: Any = None
    ) -> list[str]: ...

    async def publish(
        self,
        publisher: str,
        envelopes: Sequence[Envelope],
        chains: Sequence[str],
        connection: Any = None,
    ) -> dict[str, int]:
        """As :meth:`Batch.publish`, in one transaction (the caller's, with ``connection``)."""
        ...

    async def purge_expired_subscriptions(self, grace: float) -> int:
        """Delete subscriptions expired more than ``grace`` seconds ago; returns how many."""
        ...

    async def counts(self, queue: str) -> dict[str, int]: ...

    async def declare_limits(
        self, queue: str, flow: FlowLimits, client_id: str
    ) -> list[tuple[str, str, str, datetime]]:
        """Record the limits of ``queue``'s handlers; those another process declared
        differently: (handler, its limits, that process, when)."""
        ...

    async def flow_started(self, queue: str, starts: Sequence[tuple[str, int, int, str]]) -> None:
        """Handlers with a rate have started: (handler key, message id, attempt, claim)
        of each (nmbus/consume/dispatch/marks.py)."""
        ...

    async def flow_status(self, queues: Sequence[str] | None) -> list[LimitStatus]:
        """Each limited handler of ``queues`` (None: every queue) as last declared, and
        what its limits hold back now (as :meth:`nmbus.ops.admin.Admin.flow_status`)."""
        ...

    async def cancel(self, queue: str, request: Cancel) -> int:
        """Move the messages ``request`` names that no worker holds to F (Cancelled)."""
        ...

    async def has_ready(self, queue: str) -> bool:
        """Whether any row of ``queue`` is ready now or held by a worker."""
        ...

    async def apply_retention(self, queue: str, settings: Settings) -> None:
        """Remove (or archive) ``queue``'s rows older than the retention ages of ``settings``."""
        ...

    async def renew_leases(
        self, queue: str, ids: Sequence[int], claims: Sequence[str], lease: float
    ) -> set[int]:
        """Extend the lease of each row ``ids[i]`` still leased by ``claims[i]`` to
        ``lease`` seconds from now; returns the ids renewed."""
        ...

    async def abandon_leases(
        self,
        queue: str,
        ids: Sequence[int],
        claim: str,
        refund: bool = False,
        suspects: Collection[int] = (),
    ) -> None:
        """Free rows ``ids`` still leased by ``claim`` at once; ``refund`` when their
        attempt never started. Those of ``suspects`` (a crash's, not started here)
        come back still to be tried alone, as ``isolate`` lets its batch-mates go."""
        ...

    async def give_back(
        self, queue: str, ids: Sequence[int], attempts: Sequence[int], claim: str
    ) -> list[int]:
        """Free rows ``ids``, claimed at ``attempts`` and never started, their attempt
        not counted; a row claimed again since is left alone. Returns the ids freed."""
        ...

    def worker_session(
        self, flow: FlowLimits | None = None, idle: float | None = None
    ) -> AbstractAsyncContextManager[WorkerSession]:
        """A worker loop's session; its claims keep to ``flow``'s limits when given.

        ``idle``: the longest a batch's transaction may stay idle while its
        handlers run (their timeouts); a server that would end it sooner
        (``idle_in_transaction_session_timeout``) is told otherwise for each such
        transaction, for that transaction alone.
        """
        ...

    async def listen(self, on_wakeup: Callable[[str], None], reconnect_max: float = 10.0) -> None:
        """Call ``on_wakeup(queue)`` whenever messages are inserted into ``queue``.

        Runs until cancelled, reconnecting after connection loss with a backoff
        that grows up to ``reconnect_max`` seconds. A store that cannot listen
        (PostgreSQL behind a transaction pooler, without ``listen_dsn``) returns
        at once: the worker's loops then find new messages by polling.
        """
        ...
