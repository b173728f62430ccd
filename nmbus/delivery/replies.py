"""Requests waiting for their reply, in this process: correlation id -> future.

``bus.request`` registers a future here and sends; the dispatcher resolves it
when a reply (a message with the ``nmbus-in-reply-to`` header) with that
correlation id is handled at this endpoint. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

import asyncio

from nmbus.messages import Message


class Replies:
    """The requests of one process that are waiting for a reply."""

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self._waiting: dict[str, asyncio.Future[Message]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, correlation_id: object) -> bool:
        return correlation_id in self._waiting

    def expect(self, correlation_id: str) -> asyncio.Future[Message]:
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._waiting[correlation_id] = future
        return future

    def forget(self, correlation_id: str) -> None:
        self._waiting.pop(correlation_id, None)

    def resolve(self, correlation_id: str | None, message: Message) -> bool:
        """Hand ``message`` to the request waiting on ``correlation_id``; False if none is."""
        if correlation_id is None:
            return False
        future = self._waiting.pop(correlation_id, None)
        if future is None or future.done():
            return False
        future.set_result(message)
        return True
