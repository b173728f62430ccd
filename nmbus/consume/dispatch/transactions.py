"""Transaction modes: how a handler's writes share the batch's one transaction.

The worker picks one for each batch (or each handler, when several run at once)
and hands it to the dispatcher, which gives its ``transaction`` to the handler's
Context (what ``ctx.connection`` writes in) and asks it what to do with the
handler's savepoint once the handler is done (keep, release or undo it):

- :class:`Savepoints`, the default: a handler's first use of the connection
  takes a savepoint; a failure rolls back to it, so only its own writes go.
- :class:`SerialBatch`, for handlers that run concurrently: the same, holding
  the batch's connection lock from the first savepoint until the worker lets go
  after the handler, so that two handlers' savepoints never interleave on one
  connection.
- :class:`Unguarded`, for a batch whose handlers all have no outside effects: no
  savepoint at all; a handler that fails after writing (or that may have left
  the transaction aborted) raises :class:`Replay`, and the worker rolls the
  whole batch back and runs it again, with savepoints.
"""

from __future__ import annotations

import asyncio
from typing import Any

from nmbus.messages import StoredMessage
from nmbus.ports.store import Batch, HandlerTransaction


class Replay(Exception):
    """A batch run without savepoints must be rolled back and run again with them.

    ``row`` is the message whose handler wrote and then failed (its failure,
    ``error``, stands: it is not run again) or whose writes may have aborted
    the transaction although it returned (``error`` None: it runs again).
    """

    def __init__(self, row: StoredMessage, error: BaseException | None) -> None:
        super().__init__(f"replay the batch of message {row.id}")
        self.row = row
        self.error = error


class Savepoints:
    """The default mode: a handler's first write takes a savepoint of the batch's transaction.

    ``transaction`` is what the handler's ``ctx.connection`` writes in: here the
    batch itself. Once the handler is done, the dispatcher calls one of ``keep``,
    ``release`` or ``undo``, and only for a handler that took its savepoint.
    """

    __slots__ = ("batch", "transaction")

    #: Whether a failure after writing makes the batch run again (Unguarded).
    replays = False

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.transaction: HandlerTransaction = batch

    def keep(self) -> None:
        """The handler succeeded: its clean savepoint is released with the next one
        (a round trip saved)."""
        self.batch.defer_release()

    async def release(self, row: StoredMessage) -> None:
        """The handler succeeded, but its savepoint may be aborted (a statement failed):
        released now, so that it is this handler that fails if it is."""
        await self.batch.release_savepoint()

    async def undo(self, row: StoredMessage, error: BaseException) -> None:
        """The handler failed: its writes are rolled back, the batch's others stay."""
        await self.batch.rollback_savepoint()


class SerialBatch(Savepoints):
    """The batch's connection as one of several concurrent handlers sees it.

    Its first savepoint takes the batch's connection lock, held until the
    worker lets go (:meth:`let_go`), after the handler's savepoint is released
    or rolled back: the savepoints of two handlers never interleave on one
    connection.
    """

    __slots__ = ("_held", "_lock")

    #: The connection is shared with handlers running at once (Context.hold_connection).
    shared = True

    def __init__(self, batch: Batch, lock: asyncio.Lock) -> None:
        super().__init__(batch)
        self.transaction = self
        self._lock = lock
        self._held = False

    @property
    def connection(self) -> Any:
        return self.batch.connection

    async def savepoint(self) -> None:
        if not self._held:
            await self._lock.acquire()
            self._held = True
        await self.batch.savepoint()

    def let_go(self) -> None:
        if self._held:
            self._held = False
            self._lock.release()


class Unguarded(Savepoints):
    """The batch's transaction for handlers without outside effects: no savepoint.

    A handler's first use of ``ctx.connection`` only begins the batch's transaction.
    """

    __slots__ = ()

    replays = True

    def __init__(self, batch: Batch) -> None:
        super().__init__(batch)
        self.transaction = self

    @property
    def connection(self) -> Any:
        return self.batch.connection

    async def savepoint(self) -> None:
        await self.batch.begin()

    def keep(self) -> None:
        return None

    async def release(self, row: StoredMessage) -> None:
        # It returned, but a statement of its failed: the transaction may be aborted.
        raise Replay(row, None)

    async def undo(self, row: StoredMessage, error: BaseException) -> None:
        raise Replay(row, error) from error
