"""The saga locks of a batch: which sagas its messages name, taken before its handlers run.

:class:`SagaLocks` is what a batch of an endpoint with sagas calls around its
handlers (nmbus/consume/batch.py): it finds the saga each message names, takes those sagas for
the batch (apart in memory from the batches of the process's other loops, then
locked in the store), hands their states to the handlers
(nmbus.sagas.states.SagaStates), and writes them before each commit. The saga
types themselves and their handlers are in nmbus.sagas.saga.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol, cast

from nmbus.envelopes import SAGA_HEADER, SAGA_KEY_HEADER
from nmbus.errors import InvalidMessage, PermanentError
from nmbus.handlers import Registry
from nmbus.messages import Message
from nmbus.names import MAX_KEY_BYTES, check_text, utf8_size
from nmbus.ports.store import Batch, SagaKey, SagaTable
from nmbus.received import Received
from nmbus.sagas.states import SagaStates


class SagaLike(Protocol):
    """What the hook reads of a saga (nmbus.sagas.saga.Saga): its name, key and table."""

    name: str
    key: str | Callable[[Any], object]

    @property
    def table(self) -> SagaTable: ...


#: Keys longer than this many UTF-8 bytes are refused: a btree index entry must fit
#: in a third of a page.
MAX_KEY_LENGTH = MAX_KEY_BYTES

#: How long after a batch found one of its sagas held by another process's the
#: endpoint counts as contended (SagaLocks.contended).
CONTENDED_SECONDS = 1.0

#: What a saga key may be (a tuple: ``str | int | UUID`` would be built on every call).
KEY_TYPES = (str, int, uuid.UUID)


#: The saga locks of each registry that declares sagas (SagaLocks.of).
_LOCKS: weakref.WeakKeyDictionary[Registry, SagaLocks] = weakref.WeakKeyDictionary()


def key_text(value: object) -> str:
    """The stored form of a saga key: ``str`` of a str, int or UUID; anything else is refused.

    ``saga.load(42)`` and ``saga.load("42")`` name the same saga. Raises
    PermanentError (the message goes to F) for a key that can never work.
    """
    if isinstance(value, bool) or not isinstance(value, KEY_TYPES):
        raise PermanentError(
            f"a saga key must be a str, an int or a UUID, got {type(value).__name__}"
        )
    text = str(value)
    if not text:
        raise PermanentError("a saga key must not be empty")
    # The saga table's index counts bytes: 1,000 characters of 4 bytes each
    # failed there, on every attempt, with a driver error.
    if len(text) * 4 > MAX_KEY_LENGTH and (size := utf8_size(text)) > MAX_KEY_LENGTH:
        raise PermanentError(f"a saga key is at most {MAX_KEY_LENGTH} bytes as UTF-8, got {size}")
    try:
        check_text("saga key", text)
    except InvalidMessage as exc:
        raise PermanentError(str(exc)) from None
    return text


class SagaLocks:
    """The saga locks of an endpoint with sagas: its batches' sagas held, read and written.

    Before any handler of a batch runs, the sagas of all its messages are found
    (the key of each message for each saga handler of its type, or a timeout's
    headers), locked and read in two statements (:class:`SagaStates`); the
    handlers then work on those states in memory, and the batch writes them
    before it commits. A batch first takes only the sagas no other batch holds,
    without waiting: the messages that need one held elsewhere run after the
    rest of the batch has committed, when it holds none, and then wait for
    their sagas, taken in one order (sorted lock keys). So two batches never
    wait for each other in a cycle, and a batch whose sagas are free never
    waits at all. The loops of one process keep their batches' sagas apart in
    memory before that (see ``_hold``). A message whose key cannot be found here
    (a body that does not decode, a key callable that raises) is left to its
    handler, which fails it as before.
    """

    __slots__ = (
        "_contended_at",
        "_handlers",
        "_let_go",
        "_orders",
        "_owned",
        "_registry",
        "_sagas",
        "_taken",
        "_wanted",
        "_wants",
    )

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        # The handler function registered for each saga handler: its saga and key field.
        self._handlers: dict[Callable[..., Any], tuple[SagaLike, str | None]] = {}
        self._sagas: dict[str, SagaLike] = {}
        # The sagas the batches of this process's loops hold (by transaction), and
        # what a batch waiting for one of them waits on: set when a batch ends.
        self._taken: set[SagaKey] = set()
        self._owned: dict[int, set[SagaKey]] = {}
        self._let_go: asyncio.Event | None = None
        # The sagas batches of this process left for later and wait for (by
        # transaction), how many want each, and each batch's places (_waits).
        self._wants: dict[int, set[SagaKey]] = {}
        self._wanted: Counter[SagaKey] = Counter()
        self._orders: dict[int, tuple[int, dict[SagaKey, int]]] = {}
        # When a batch last found one of its sagas held by another process's.
        self._contended_at = float("-inf")

    @classmethod
    def of(cls, registry: Registry) -> SagaLocks:
        """The saga locks of ``registry``'s batches, made when its first saga is declared."""
        found = _LOCKS.get(registry)
        if found is None:
            found = _LOCKS[registry] = cls(registry)
        return found

    @staticmethod
    def found(registry: Registry) -> SagaLocks | None:
        """The saga locks of ``registry``, None while it declares no saga."""
        return _LOCKS.get(registry)

    def add(self, func: Callable[..., Any], saga: SagaLike, field: str | None) -> None:
        self._handlers[func] = (saga, field)
        self._sagas[saga.name] = saga

    async def prepare(
        self,
        tx: Batch,
        batch: list[Received],
        wait: bool,
        table: SagaTable,
    ) -> set[int]:
        """Take the sagas of ``batch`` in ``tx``, from ``table`` (the saga table of the
        store the batch runs on); the ids of the messages left for later."""
        if wait:
            # The commit before this let go of the batch's sagas, here as in PostgreSQL.
            self._let_go_of(tx)
        needs: list[tuple[Received, set[SagaKey]]] = []
        keys: set[SagaKey] = set()
        for received in batch:
            received.sagas = None
            found = received.found
            if found is None:
                # Found once: a batch that waits for its sagas is prepared again.
                found = received.found = self._sagas_of(received)
            if found:
                names = {(saga.name, key) for saga, key in found}
                needs.append((received, names))
                keys |= names
        if not needs:
            if self._sagas:
                states = SagaStates(table)
                for received in batch:
                    received.sagas = states
            return set()
        states = SagaStates(table)
        if wait:
            if id(tx) not in self._orders:
                # Here after a part commit of its own (batch_commit_interval), not
                # after leaving messages for later: every message left waits.
                self._orders[id(tx)] = _places(needs)
            self._want(tx, keys)
            await self._free_here(tx, keys)
            self._hold(tx, keys)
            await tx.begin()
            taken = await states.take(tx.connection, keys, True)
        else:
            # The sagas another loop's batch holds in this process, or waits for, are
            # left for later without a statement (a batch claimed after the waiting
            # one never runs its saga's messages first); of the rest, those free in
            # PostgreSQL are taken.
            mine = keys - self._taken - self._wanted.keys()
            self._hold(tx, mine)
            taken = set()
            if mine:
                await tx.begin()
                taken = await states.take(tx.connection, mine, False)
                if taken != mine:
                    # Held by another process's batch (this process's are apart in
                    # memory first): the endpoint meets contention (contended).
                    self._contended_at = time.monotonic()
        for received in batch:
            # Also for a message whose sagas were not found here: should its handler
            # find one (_held), it takes it into the batch's one SagaStates.
            received.sagas = states
        later: set[int] = set()
        # The sagas of the messages left for later: a message after one of them that
        # names one of them waits too, so that each saga sees its messages in order.
        behind: set[SagaKey] = set()
        for received, names in needs:
            if not names <= taken or not names.isdisjoint(behind):
                later.add(received.row.id)
                behind |= names
                received.sagas = None
        if behind and not wait:
            # Its places among the batches waiting for sagas (_waits).
            self._orders[id(tx)] = _places([n for n in needs if n[0].row.id in later])
            self._want(tx, behind)
        return later

    # The loops of one process keep their batches' sagas apart in memory first:
    # without it, a batch whose sagas a sibling loop holds would take a part of
    # them in PostgreSQL each time the sibling commits, and run its batch in many
    # parts, each with its commit. A batch holds in memory what it takes in
    # PostgreSQL (and what it leaves for later, it waits for here first); as in
    # PostgreSQL, a commit lets go of all of it, and a batch waits only while it
    # holds nothing, so two batches never wait for each other.

    def _hold(self, tx: Batch, keys: set[SagaKey]) -> None:
        self._taken |= keys
        self._owned.setdefault(id(tx), set()).update(keys)
        self._unwant(tx)

    def _want(self, tx: Batch, keys: set[SagaKey]) -> None:
        """The batch of ``tx`` will wait for ``keys``: newer batches leave them to it."""
        self._unwant(tx)
        self._wants[id(tx)] = keys
        self._wanted.update(keys)

    def _unwant(self, tx: Batch) -> None:
        keys = self._wants.pop(id(tx), None)
        if keys:
            self._wanted.subtract(keys)
            for key in keys:
                if self._wanted[key] <= 0:
                    del self._wanted[key]
            self._wake()

    async def _free_here(self, tx: Batch, keys: set[SagaKey]) -> None:
        """Wait until no batch of this process holds any of ``keys``, nor waits with an
        older message of one of them (_waits): each saga runs its messages in the
        order claimed."""
        while not keys.isdisjoint(self._taken) or self._waits_for_another(tx):
            if self._let_go is None:
                self._let_go = asyncio.Event()
            await self._let_go.wait()

    def _waits_for_another(self, tx: Batch) -> bool:
        """Whether the batch of ``tx`` waits for another waiting batch (_waits)."""
        return bool(self._waits().get(id(tx)))

    def _waits(self) -> dict[int, set[int]]:
        """Which waiting batch waits for which, among those of this process.

        A batch goes after one that waits with an older message (by id: its place
        in the queue, not when its claim answered, since two loops' claims answer
        in any order and a held claim commits its record first) of a saga both
        wait for. Two batches can hold messages of two sagas crossed (a1 and b4
        against a2 and b3), or a ring of them across three batches: were every
        such wait kept, the loops would wait for each other for ever. So the
        waits toward the batch whose oldest message left for later is older are
        kept first (they alone make no cycle), then each of the others unless it
        would close one; of two batches whose wait was dropped, whichever takes
        the saga first runs first.
        """
        orders, wants = self._orders, self._wants
        empty: tuple[int, dict[SagaKey, int]] = (0, {})
        edges: list[tuple[bool, int, int, int, int]] = []
        for waiter, wanted in wants.items():
            place, mine = orders.get(waiter, empty)
            for other, theirs_wanted in wants.items():
                if other == waiter:
                    continue
                their_place, theirs = orders.get(other, empty)
                if any(
                    k in theirs and k in mine and theirs[k] < mine[k]
                    for k in wanted & theirs_wanted
                ):
                    edges.append((their_place >= place, place, their_place, waiter, other))
        kept: dict[int, set[int]] = {}
        for _, _, _, waiter, other in sorted(edges):
            if not _reaches(kept, other, waiter):
                kept.setdefault(waiter, set()).add(other)
        return kept

    def _let_go_of(self, tx: Batch) -> None:
        """Let go of what the batch of ``tx`` holds."""
        keys = self._owned.pop(id(tx), None)
        if keys:
            self._taken -= keys
            self._wake()

    def _wake(self) -> None:
        let_go, self._let_go = self._let_go, None
        if let_go is not None:
            let_go.set()

    def contended(self) -> bool:
        return time.monotonic() - self._contended_at <= CONTENDED_SECONDS

    def released(self, tx: Batch, rest: list[Received]) -> None:
        # The stopping worker runs no more of them: none takes its sagas again, and
        # a handler already started takes its own (_held), its old states let go of.
        self._let_go_of(tx)
        for received in rest:
            received.sagas = None

    def done(self, tx: Batch) -> None:
        self._let_go_of(tx)
        self._unwant(tx)
        self._orders.pop(id(tx), None)

    async def flush(self, tx: Batch, batch: list[Received]) -> None:
        written: set[int] = set()
        for received in batch:
            states = received.sagas
            if states is not None and id(states) not in written:
                written.add(id(states))
                await states.write(tx.connection)

    def _sagas_of(self, received: Received) -> list[tuple[SagaLike, str]]:
        row = received.row
        # A timeout names its saga and key in headers; the message's other sagas
        # (if its type has handlers in several) find theirs as any message does.
        timeout: tuple[SagaLike, str] | None = None
        if received.mentions(SAGA_HEADER):
            try:
                headers = received.headers
                saga = self._sagas.get(headers.get(SAGA_HEADER, ""))
                if saga is not None:
                    timeout = (saga, key_text(headers.get(SAGA_KEY_HEADER)))
            except (ValueError, TypeError, PermanentError):
                pass
        cls = received.cls
        if cls is None:
            return []
        found: list[tuple[SagaLike, str]] = []
        message: Message | None = None
        for handler in self._registry.handlers_for(cls):
            entry = self._handlers.get(handler.func)
            if entry is None:
                continue
            saga, field = entry
            if timeout is not None and saga is timeout[0]:
                found.append(timeout)
                continue
            try:
                if message is None:
                    message = self._registry.codec.decode(cls, row.msg_text or "", row.msg_headers)
                    received.message = message  # its handlers need not decode it again
                if field is not None:
                    value = getattr(message, field)
                else:
                    value = cast("Callable[[Any], object]", saga.key)(message)
                found.append((saga, key_text(value)))
            except Exception:
                # Its handler meets the same error and fails the message.
                continue
        return found


def _places(needs: list[tuple[Received, set[SagaKey]]]) -> tuple[int, dict[SagaKey, int]]:
    """A waiting batch's places: the oldest of the messages it waits with (their
    ids), and its oldest for each saga they name."""
    firsts: dict[SagaKey, int] = {}
    for received, names in needs:
        for name in names:
            if received.row.id < firsts.get(name, received.row.id + 1):
                firsts[name] = received.row.id
    return min((received.row.id for received, _ in needs), default=0), firsts


def _reaches(waits: dict[int, set[int]], start: int, goal: int) -> bool:
    """Whether ``start`` waits, through ``waits``, for ``goal`` (or is it)."""
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(waits.get(node, ()))
    return False
