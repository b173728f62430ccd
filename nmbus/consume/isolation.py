"""After a crash: which message to blame, and how to find out.

A worker that dies with a batch in hand cannot say which message killed it.
The claim tells how each row came back (``StoredMessage.recovered``); when a
batch holds a row that came back from a crash, :func:`isolate` keeps one
suspect and lets the rest go, and the worker runs the suspect through the
process's :class:`Gate` alone, with no other handler of the process running.
A death now is the suspect's own (``isolated``): a message is failed for
dying (``AttemptsExhausted``) only after such deaths, so a message that keeps
killing workers ends in F and its batch-mates do not. docs/message-lifecycle.md
draws it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from nmbus.errors import caused_by
from nmbus.messages import StoredMessage
from nmbus.ports.store import WorkerSession

# StoredMessage.recovered, as the claim query computes it.
FRESH = 0  # never leased, or given back in order
LET_GO = 1  # let go by isolate(): still to be tried alone
DIED_IN_BATCH = 2  # its holder's lease ran out with a batch in hand
DIED_ALONE = 3  # its holder's lease ran out while it ran alone: the holder died on it


class Gate:
    """Batches of one process share it; a suspect after a crash runs with it alone.

    While a suspect runs, no other handler of the process does (whatever Bus
    it belongs to): if the process dies, the suspect alone is to blame.
    """

    __slots__ = ("_idle", "_open", "_running")

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._running = 0

    @property
    def closed(self) -> bool:
        return not self._open.is_set()

    async def enter(self) -> None:
        while not self._open.is_set():
            await self._open.wait()
        self._running += 1
        self._idle.clear()

    def leave(self) -> None:
        self._running -= 1
        if not self._running:
            self._idle.set()

    @asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        while not self._open.is_set():
            await self._open.wait()
        self._open.clear()
        try:
            await self._idle.wait()
            yield
        finally:
            self._open.set()


#: SQLSTATEs of a transaction that lost to a concurrent one: deadlock_detected and
#: serialization_failure. Rolled back and tried again, they cost no attempt.
CONFLICT_STATES = frozenset({"40P01", "40001"})


def is_conflict(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a deadlock or a serialization failure."""
    return caused_by(exc, CONFLICT_STATES)


_GATES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Gate] = weakref.WeakKeyDictionary()


def process_gate() -> Gate:
    """The one gate of this process's event loop, shared by all its workers."""
    loop = asyncio.get_running_loop()
    gate = _GATES.get(loop)
    if gate is None:
        gate = _GATES[loop] = Gate()
    return gate


async def isolate(
    session: WorkerSession, queue: str, batch: list[StoredMessage], claim: str
) -> StoredMessage:
    """Keep one suspect of ``batch`` (which holds a recovered row) and let the rest go.

    A suspect that already died alone is taken first (it is likely failed at
    once, without running). The rows let go get this claim's attempt back, in
    a statement committed before the suspect runs (and the crash's, when they
    died in a batch); those that came back from the crash keep a mark so that
    they too are tried alone.
    """
    suspect = next((m for m in batch if m.recovered == DIED_ALONE), None)
    if suspect is None:
        suspect = next(m for m in batch if m.recovered)
    ids = [m.id for m in batch]
    marks = [m is not suspect and bool(m.recovered) for m in batch]
    # A row let go gets this claim's attempt back, and the crash's when it died in
    # a batch: nothing says it killed the worker. The suspect keeps its count.
    refunds = [1 + (m.recovered == DIED_IN_BATCH) for m in batch]
    await session.isolate(queue, ids, suspect.id, marks, claim, refunds)
    return suspect
