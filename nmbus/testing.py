"""Test helpers: handlers and sagas without a worker or a database, an in-memory
store that runs the real worker, and ``drain``.

* :class:`HandlerTest` runs one message through an endpoint's own handling, as
  a worker would, and records what its handlers sent, published and replied,
  the saga timeouts they set, and the outcome (docs/testing.md, level 1).
* :class:`SagaScenario` runs a saga's messages and moves a clock, so that its
  timeouts run when they fall due, in due order (level 2).
* ``MemoryStore`` follows the storage port's contract as the PostgreSQL store
  does (``tests/test_store_contract.py`` runs against both), so sending,
  handling, publish/subscribe, retries and shutdown can be tested without a
  database. It has no SQL connection: handlers that use ``ctx.connection``
  need the real store, and operations (Admin, the dashboard) run on PostgreSQL
  only. The store itself is :mod:`nmbus.memory`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, cast

from nmbus.consume.batch import BatchRunner
from nmbus.consume.claim import Claims
from nmbus.consume.dispatch import Dispatcher
from nmbus.delivery.flow import GROUP_HEADER
from nmbus.envelopes import (
    IN_REPLY_TO_HEADER,
    INTERNAL_PREFIX,
    REPLY_TO_HEADER,
    SAGA_HEADER,
    EnvelopeBuilder,
    Outgoing,
    user_headers,
)
from nmbus.errors import ConfigurationError
from nmbus.memory.sagas import MemoryConnection, MemorySagaTable
from nmbus.memory.store import MemoryBatch, MemorySession, MemoryStore
from nmbus.messages import Envelope, Message, lookup_type
from nmbus.ports.store import Outcomes, SagaTable, Store
from nmbus.rows import QueueRow
from nmbus.sagas.locks import key_text

if TYPE_CHECKING:
    from pydantic import BaseModel

    from nmbus.bus import Bus
    from nmbus.sagas.saga import Saga

__all__ = [
    "HandlerTest",
    "MemoryBatch",
    "MemorySession",
    "MemoryStore",
    "Outcome",
    "Row",
    "SagaScenario",
    "Sent",
    "drain",
]

#: One row of an in-memory queue table, with the same columns as the real one.
Row = QueueRow

_NO_DATABASE = (
    "HandlerTest runs without a database: a handler that uses ctx.connection is "
    "tested on PostgreSQL (docs/testing.md, level 3)"
)


async def drain(bus: Bus, timeout: float = 10.0, queues: Sequence[str] | None = None) -> None:
    """Wait until ``queues`` (default: the bus's own) hold nothing ready or in flight.

    Scheduled rows whose time has not come do not count. Raises TimeoutError.
    """
    names = list(queues) if queues is not None else [bus.endpoint]
    async with asyncio.timeout(timeout):
        while True:
            busy = bus.worker.in_flight or any([await bus.store.has_ready(q) for q in names])
            if not busy:
                return
            await asyncio.sleep(0.02)


# -- what a handling did -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sent:
    """A message a handler sent, published, replied or set as a saga timeout.

    ``to`` is None for a publish. ``headers`` are the headers it carries but
    nmbus's own (``nmbus-*``): the travelling ones, the handler's and what the
    outgoing hooks added; ``group`` and ``reply_to`` are the send's options of
    those names. ``delay`` is the seconds from the handling to ``deliver_at``
    (None: ready at once), on the test's clock.
    """

    message: Message
    to: str | None
    headers: dict[str, str]
    delay: float | None
    deliver_at: datetime | None
    unique_id: str
    correlation_id: str | None
    priority: int = 0
    sequence: str | None = None
    expires_at: datetime | None = None
    group: str | None = None
    reply_to: str | None = None
    #: The envelope as it would be stored (SagaScenario delivers a timeout's).
    envelope: Envelope = field(repr=False, compare=False, default=None)  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of a handled message, as the worker would record it.

    ``status``: ``processed`` (X), ``retry`` (R, again at ``retry_at``, after
    the bus's retry policy or a RetryLater) or ``failed`` (F). ``error_info`` is
    what the row would hold (its first line, ``Type: message``, is ``error``);
    a processed message can hold a note (a stale saga timeout's, say).
    """

    status: Literal["processed", "retry", "failed"]
    retry_at: datetime | None = None
    error_info: str | None = None

    @property
    def processed(self) -> bool:
        return self.status == "processed"

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    @property
    def retrying(self) -> bool:
        return self.status == "retry"

    @property
    def error(self) -> str | None:
        """The first line of ``error_info``: ``Type: message``."""
        return None if self.error_info is None else self.error_info.split("\n", 1)[0]


# -- the store a HandlerTest's batches run on ------------------------------------------


class _RecordingBatch(MemoryBatch):
    """A batch whose commit records what it would store, instead of storing it."""

    def __init__(self, store: _RecordingStore) -> None:
        super().__init__(store)
        self._recording = store
        self._connection = MemoryConnection(_NO_DATABASE)
        self._sends: list[tuple[str, list[Envelope]]] = []
        self._published: list[Envelope] = []
        self._outcomes: list[Outcomes] = []

    @property
    def connection(self) -> Any:
        return self._connection

    async def insert(self, queue: str, from_endpoint: str, envelopes: Sequence[Envelope]) -> int:
        self._sends.append((queue, list(envelopes)))
        return len(envelopes)

    async def publish(
        self, publisher: str, envelopes: Sequence[Envelope], chains: Sequence[str]
    ) -> dict[str, int]:
        self._published.extend(envelopes)
        return {}

    async def finish(self, queue: str, outcomes: Outcomes, claim: str) -> int:
        self._outcomes.append(outcomes)
        return await super().finish(queue, outcomes, claim)

    def _commit(self) -> None:
        self._connection.commit()
        record = self._recording.record
        for queue, envelopes in self._sends:
            for envelope in envelopes:
                record(envelope, queue)
        for envelope in self._published:
            record(envelope, None)
        for outcomes in self._outcomes:
            self._recording.outcomes(outcomes)
        self._sends, self._published, self._outcomes = [], [], []
        super()._commit()


class _RecordingSession(MemorySession):
    def __init__(self, store: _RecordingStore) -> None:
        super().__init__(store)
        self._recording = store

    @asynccontextmanager
    async def batch(self) -> AsyncIterator[MemoryBatch]:
        batch = _RecordingBatch(self._recording)
        yield batch
        batch._commit()


class _RecordingStore(MemoryStore):
    """The memory store a HandlerTest runs its batches on, sagas in memory."""

    def __init__(self, test: HandlerTest) -> None:
        super().__init__()
        self._test = test
        self.sagas = MemorySagaTable()
        self.finished: dict[int, tuple[str | None, float | None, str | None]] = {}

    def saga_table(self, endpoint: str) -> SagaTable:
        return self.sagas

    async def ensure_sagas(self, endpoint: str) -> None:
        return None

    def record(self, envelope: Envelope, to: str | None) -> None:
        self._test._record(envelope, to)

    def outcomes(self, outcomes: Outcomes) -> None:
        for i, row_id in enumerate(outcomes.ids):
            self.finished[row_id] = (
                outcomes.subqueue[i],
                outcomes.delay[i],
                outcomes.error_info[i],
            )


def _utc_now() -> datetime:
    return datetime.now(UTC)


class HandlerTest:
    """Run messages through ``bus``'s own handling, without a worker or a database.

    ``await t.handle(message, headers=...)`` does what a worker does with one
    claimed message: its body is encoded and decoded and validated as stored,
    the endpoint's middleware runs around its handlers (sagas included, their
    states kept in memory), under their timeouts, and the outcome is what the
    worker would record (:class:`Outcome`, also ``t.outcome``). What the
    handlers send is recorded, not stored, and only when the message succeeds
    (its transaction commits): ``t.sent``, ``t.published``, ``t.replies`` and
    ``t.timeouts`` (saga timeouts), each a list of :class:`Sent`, in order, over
    every ``handle`` of this test. Sends pass the bus's outgoing hooks.

    ``now``: the clock delays count from (default: the real one, read once per
    handling). A handler that uses ``ctx.connection`` fails with
    ConfigurationError: test it on PostgreSQL. Messages are handled one at a
    time; call ``handle`` from the test's own event loop.
    """

    def __init__(self, bus: Bus, *, now: Callable[[], datetime] | None = None) -> None:
        self.bus = bus
        self.sent: list[Sent] = []
        self.published: list[Sent] = []
        self.replies: list[Sent] = []
        self.timeouts: list[Sent] = []
        self.outcome: Outcome | None = None
        self._clock = now or _utc_now
        self._at = self._clock()
        self.store = _RecordingStore(self)
        # The bus's own registration (handlers, sagas, middleware), retry policy
        # and settings; envelopes on the test's clock.
        self._builder = EnvelopeBuilder(
            bus.settings.max_message_bytes,
            now=lambda: self._at,
            codec=bus.registry.codec,
            claim_check_bytes=bus.settings.claim_check_bytes,
        )
        dispatcher = Dispatcher(bus.endpoint, bus.registry, bus.retry, bus.settings, self._builder)
        self._claims = Claims("nmbus-testing", bus.settings.lease_seconds)
        self._runner = BatchRunner(
            queue=bus.endpoint,
            # A memory store declares no flow limits (nor does a test run them).
            store=cast("Store", self.store),
            dispatcher=dispatcher,
            settings=bus.settings,
            claims=self._claims,
            dead_letter=None,
            metrics=None,
            stopping=asyncio.Event(),
        )
        self._lock = asyncio.Lock()

    async def handle(
        self,
        message: Message,
        *,
        headers: Mapping[str, str] | None = None,
        attempt: int = 1,
        from_endpoint: str = "test",
        correlation_id: str | None = None,
        unique_id: str | None = None,
    ) -> Outcome:
        """Handle ``message`` as the endpoint's worker would, as sent by ``from_endpoint``.

        ``attempt`` is the attempt it is (``ctx.retry_count``): the last one the
        retry policy allows fails it for good. Returns its :class:`Outcome`.
        """
        options = Outgoing(user_headers(headers), unique_id, correlation_id)
        envelope = self._builder.for_send(message, self.bus.endpoint, options)
        return await self.deliver(envelope, from_endpoint=from_endpoint, attempt=attempt)

    async def deliver(
        self, envelope: Envelope, *, from_endpoint: str = "test", attempt: int = 1
    ) -> Outcome:
        """Handle a stored envelope (a recorded saga timeout's, say) as a claimed row."""
        if not isinstance(attempt, int) or attempt < 1:
            raise ConfigurationError(f"attempt must be an int >= 1, got {attempt!r}")
        queue = self.bus.endpoint
        async with self._lock:
            self._at = self._clock()
            self._builder.hooks = self.bus.envelopes.hooks
            # Its time has come (on the test's clock): ready now.
            await self.store.insert(queue, from_endpoint, [replace(envelope, deliver_at=None)])
            table = self.store.tables[queue]
            row_id = max(table)
            table[row_id] = replace(table[row_id], retry_count=attempt - 1)
            session = _RecordingSession(self.store)
            token = self._claims.token("test")
            since = time.monotonic()
            rows = await session.claim(queue, 1, token, self.bus.settings.lease_seconds)
            claim = self._claims.take(token, rows, since)
            assert claim is not None, "the message was not claimable"
            try:
                # From here on it is the worker's own path: the batch runner takes the
                # saga locks, the dispatcher decodes the row (where an upcaster of an
                # older version would run) and validates it, runs the middleware and
                # the handlers, and the outcome and the sends are committed.
                await self._runner.process(session, claim)
            finally:
                self._claims.end(claim)
                table.pop(row_id, None)
            subqueue, delay, info = self.store.finished.pop(row_id, (None, None, None))
        if subqueue == "X":
            outcome = Outcome("processed", error_info=info)
        elif subqueue == "R":
            outcome = Outcome("retry", self._at + timedelta(seconds=delay or 0.0), info)
        elif subqueue == "F":
            outcome = Outcome("failed", error_info=info)
        else:
            raise AssertionError(f"the message got no outcome ({subqueue!r})")
        self.outcome = outcome
        return outcome

    def _record(self, envelope: Envelope, to: str | None) -> None:
        cls = lookup_type(envelope.label)
        assert cls is not None, envelope.label
        message = self.bus.registry.codec.decode(cls, envelope.msg_text, envelope.msg_headers)
        loaded = json.loads(envelope.msg_headers) if envelope.msg_headers else {}
        headers = {
            k: v for k, v in loaded.items() if k[: len(INTERNAL_PREFIX)].lower() != INTERNAL_PREFIX
        }
        when = envelope.deliver_at
        sent = Sent(
            message=message,
            to=to,
            headers=headers,
            delay=None if when is None else (when - self._at).total_seconds(),
            deliver_at=when,
            unique_id=envelope.unique_id,
            correlation_id=envelope.correlation_id,
            priority=envelope.priority,
            sequence=envelope.sequence,
            expires_at=envelope.expires_at,
            group=loaded.get(GROUP_HEADER),
            reply_to=loaded.get(REPLY_TO_HEADER),
            envelope=envelope,
        )
        if to is None:
            self.published.append(sent)
        elif IN_REPLY_TO_HEADER in loaded:
            self.replies.append(sent)
        elif SAGA_HEADER in loaded and to == self.bus.endpoint:
            self.timeouts.append(sent)
        else:
            self.sent.append(sent)


class SagaScenario:
    """A saga of ``bus`` run message by message, with a clock the test moves.

    ``await s.handle(message)`` handles a message as :class:`HandlerTest` does
    (``s.test`` is that HandlerTest: ``s.test.sent`` ...); the saga timeouts its
    handlers set wait until ``await s.advance(timedelta(...))`` moves the clock
    past them, and then run in due order (a timeout set by one that runs is
    itself run if it falls due before the clock stops). ``state`` is the saga
    with ``key``'s state now (None: not started, or completed) and
    ``completed`` whether it was started and has completed since. ``saga``
    names the saga when the endpoint has several; ``start`` is where the clock
    starts (default: now).
    """

    def __init__(
        self,
        bus: Bus,
        key: object,
        *,
        saga: str | None = None,
        start: datetime | None = None,
    ) -> None:
        if saga is None and len(bus.sagas) != 1:
            raise ConfigurationError(
                f"endpoint {bus.endpoint!r} has {len(bus.sagas)} sagas: say which, saga=NAME"
            )
        name = saga if saga is not None else next(iter(bus.sagas))
        if name not in bus.sagas:
            raise ConfigurationError(f"endpoint {bus.endpoint!r} has no saga named {name!r}")
        self.saga: Saga[Any] = bus.sagas[name]
        self.key = key_text(key)
        if start is not None and start.tzinfo is None:
            raise ConfigurationError("start must be a timezone-aware datetime")
        self.now = start or _utc_now()
        self.test = HandlerTest(bus, now=lambda: self.now)
        self._started = False
        # The timeouts not run yet (indexes into test.timeouts are taken once).
        self._taken = 0
        self._due: list[tuple[datetime, int, Sent]] = []
        self._order = 0

    async def handle(self, message: Message, **options: Any) -> Outcome:
        """Handle ``message`` now (``HandlerTest.handle``'s options)."""
        outcome = await self.test.handle(message, **options)
        self._collect()
        return outcome

    async def advance(self, by: timedelta) -> list[Outcome]:
        """Move the clock ``by`` on, running each timeout that falls due, in due order."""
        if not isinstance(by, timedelta) or by < timedelta(0):
            raise ConfigurationError(f"advance by a timedelta >= 0, got {by!r}")
        until = self.now + by
        ran: list[Outcome] = []
        while self._due:
            self._due.sort(key=lambda item: (item[0], item[1]))
            due, _, timeout = self._due[0]
            if due > until:
                break
            self._due.pop(0)
            self.now = max(self.now, due)
            ran.append(await self.test.deliver(timeout.envelope, from_endpoint=self.saga.endpoint))
            self._collect()
        self.now = until
        return ran

    @property
    def pending(self) -> list[Sent]:
        """The timeouts set and not run yet, in due order."""
        return [t for _, _, t in sorted(self._due, key=lambda item: (item[0], item[1]))]

    @property
    def state(self) -> BaseModel | None:
        found = self.test.store.sagas.rows.get((self.saga.name, self.key))
        if found is None or found.state is None:
            return None
        state: BaseModel = self.saga.model.model_validate_json(found.state)
        return state

    @property
    def completed(self) -> bool:
        return self._started and self.state is None

    def _collect(self) -> None:
        if self.state is not None:
            self._started = True
        for timeout in self.test.timeouts[self._taken :]:
            self._order += 1
            self._due.append((timeout.deliver_at or self.now, self._order, timeout))
        self._taken = len(self.test.timeouts)
