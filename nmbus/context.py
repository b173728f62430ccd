"""What a handler gets beside its message: metadata, the connection, send/publish."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from nmbus.messages import Envelope, Message, StoredMessage

if TYPE_CHECKING:
    import asyncpg

    from nmbus.bus import Bus
    from nmbus.store import Batch


class HandlerConnection:
    """The worker's connection, as a handler sees it.

    It is the connection of the batch's transaction. The first time a handler
    uses it, a savepoint is taken, so a failing handler rolls back only its own
    writes; handlers that never touch it cost no savepoint at all. Every
    coroutine method of ``asyncpg.Connection`` is available.
    """

    __slots__ = ("_batch", "_ctx")

    def __init__(self, ctx: Context, batch: Batch) -> None:
        self._ctx = ctx
        self._batch = batch

    async def _enter(self) -> asyncpg.Connection:
        if not self._ctx._savepoint:
            await self._batch.savepoint()
            self._ctx._savepoint = True
        conn: asyncpg.Connection = self._batch.connection
        return conn

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        conn = await self._enter()
        try:
            return await getattr(conn, method)(*args, **kwargs)
        except BaseException:
            # The transaction may now be aborted: the worker must find out at once.
            self._ctx._tainted = True
            raise

    async def execute(self, query: str, *args: Any, timeout: float | None = None) -> str:
        result: str = await self._call("execute", query, *args, timeout=timeout)
        return result

    async def executemany(self, query: str, args: Any, *, timeout: float | None = None) -> None:
        await self._call("executemany", query, args, timeout=timeout)

    async def fetch(self, query: str, *args: Any, timeout: float | None = None) -> list[Any]:
        return list(await self._call("fetch", query, *args, timeout=timeout))

    async def fetchrow(self, query: str, *args: Any, timeout: float | None = None) -> Any:
        return await self._call("fetchrow", query, *args, timeout=timeout)

    async def fetchval(
        self, query: str, *args: Any, column: int = 0, timeout: float | None = None
    ) -> Any:
        return await self._call("fetchval", query, *args, column=column, timeout=timeout)

    async def copy_records_to_table(self, table_name: str, **kwargs: Any) -> str:
        result: str = await self._call("copy_records_to_table", table_name, **kwargs)
        return result

    async def raw(self) -> asyncpg.Connection:
        """The underlying asyncpg connection, with the handler's savepoint taken."""
        # What happens on it is unknown to us: treat its savepoint as possibly aborted.
        self._ctx._tainted = True
        return await self._enter()


class Context:
    """Everything a handler knows about the message it handles."""

    __slots__ = (
        "_batch",
        "_bus",
        "_connection",
        "_headers",
        "_outbox",
        "_row",
        "_savepoint",
        "_tainted",
        "queue",
    )

    def __init__(self, bus: Bus, queue: str, row: StoredMessage, batch: Batch) -> None:
        self._bus = bus
        self.queue = queue
        self._row = row
        self._batch = batch
        self._savepoint = False
        # A statement failed on the connection, or raw() handed it out.
        self._tainted = False
        # (queue, envelope) to send, or (None, envelope) to publish, at commit.
        self._outbox: list[tuple[str | None, Envelope]] = []
        self._connection: HandlerConnection | None = None
        self._headers: dict[str, str] | None = None

    @property
    def message_id(self) -> int:
        """The row id in this endpoint's queue table."""
        return self._row.id

    @property
    def unique_id(self) -> str:
        return self._row.unique_id

    @property
    def correlation_id(self) -> str | None:
        return self._row.correlation_id

    @property
    def from_endpoint(self) -> str:
        return self._row.from_endpoint

    @property
    def retry_count(self) -> int:
        """Attempts made so far, this one included (1 on the first attempt)."""
        return self._row.retry_count

    @property
    def insert_time(self) -> datetime:
        return self._row.insert_time

    @property
    def label(self) -> str | None:
        return self._row.label

    @property
    def headers(self) -> Mapping[str, str]:
        if self._headers is None:
            raw = self._row.msg_headers
            self._headers = json.loads(raw) if raw else {}
        return self._headers

    @property
    def connection(self) -> HandlerConnection:
        """The connection of the transaction this message is handled in."""
        if self._connection is None:
            self._connection = HandlerConnection(self, self._batch)
        return self._connection

    async def send(
        self,
        message: Message,
        to: str,
        *,
        deliver_at: datetime | None = None,
        delay: float | None = None,
        headers: Mapping[str, str] | None = None,
        unique_id: str | None = None,
    ) -> str:
        """Send ``message`` to queue ``to`` when this handler's transaction commits."""
        envelope = self._bus._outgoing(
            message,
            to,
            self.correlation_id or self.unique_id,
            headers,
            unique_id,
            deliver_at,
            delay,
        )
        self._outbox.append((to, envelope))
        return envelope.unique_id

    async def publish(
        self,
        message: Message,
        *,
        headers: Mapping[str, str] | None = None,
        unique_id: str | None = None,
        deliver_at: datetime | None = None,
        delay: float | None = None,
    ) -> str:
        """Publish ``message`` to every subscriber, in this handler's transaction.

        The copies are stored when the handler succeeds, with the batch's
        commit (one server call for everything the batch published), and carry
        this message's correlation id. Returns the publish id: each copy's
        unique_id is ``<publish id>/<subscriber>``.
        """
        envelope, _ = self._bus._publish_envelope(
            message,
            self.correlation_id or self.unique_id,
            headers,
            unique_id,
            self._bus._deliver_time(deliver_at, delay),
        )
        self._outbox.append((None, envelope))
        return envelope.unique_id

    async def reply(self, message: Message, *, headers: Mapping[str, str] | None = None) -> str:
        """Send ``message`` back to the endpoint that sent the message being handled."""
        return await self.send(message, to=self.from_endpoint, headers=headers)
