"""The starts of rate-limited handlers, marked in the store after they happen.

A rate counts handler starts in every window of its length (nmbus/delivery/flow.py).
The store counts a claimed message as a start from its claim until its mark,
then at the mark's time; that time must never come before the real start, or
a window of real starts could hold more than the rate. So the dispatcher calls
:meth:`StartMarks.started` just before it calls such a handler, and the mark's
statement runs in a task of its own, which the event loop runs only once the
handler has started and given way. Starts that come while a mark is on its way
go in the next statement together, and the finish of a batch marks whatever is
still on its way first (``flow_finishing``), so a start is counted without a
gap from its claim until its window has passed.
"""

from __future__ import annotations

import asyncio

import structlog

from nmbus.errors import StoreError
from nmbus.messages import StoredMessage
from nmbus.ports.store import Store

log = structlog.get_logger("nmbus.worker")

#: How long a stopping worker waits for the marks on their way.
CLOSE_WAIT = 5.0


class StartMarks:
    """Marks the starts of one worker's rate-limited handlers, a statement at a time."""

    def __init__(self, store: Store, queue: str) -> None:
        self.store = store
        self.queue = queue
        self._pending: list[tuple[str, int, int, str]] = []
        self._task: asyncio.Task[None] | None = None

    def started(self, row: StoredMessage, key: str) -> None:
        """Handler ``key`` of ``row`` is about to be called: mark it once it has started."""
        self._pending.append((key, row.id, row.retry_count, row.claim))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._mark(), name=f"nmbus-marks-{self.queue}"
            )

    async def _mark(self) -> None:
        while self._pending:
            starts, self._pending = self._pending, []
            try:
                await self.store.flow_started(self.queue, starts)
            except StoreError as exc:
                # The finish marks them instead (flow_finishing); until then they
                # count as starts for as long as their claim lasts: safe.
                log.warning("flow_start_not_marked", queue=self.queue, error=str(exc))

    async def close(self) -> None:
        """Let the marks on their way land (the worker stops), for at most CLOSE_WAIT s."""
        task, self._task = self._task, None
        if task is None or task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), CLOSE_WAIT)
        except TimeoutError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
