"""What a handler gets beside its message: metadata, the connection, send/publish.

What a handler does besides returning is collected in its :class:`Effects`,
a plain public object the worker reads once the handler is done: the messages
to send and publish when the batch commits, and the state of the handler's
savepoint. The Context knows nothing of the Bus: envelopes come from the same
:class:`~nmbus.envelopes.EnvelopeBuilder` the Bus uses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, Unpack

from nmbus.delivery.flow import GROUP_HEADER
from nmbus.envelopes import (
    IN_REPLY_TO_HEADER,
    REPLY_BY_HEADER,
    REPLY_TO_HEADER,
    REQUESTER_HEADER,
    SAGA_HEADER,
    SAGA_INSTANCE_HEADER,
    SAGA_KEY_HEADER,
    EnvelopeBuilder,
    Outgoing,
    PublishOptions,
    SendOptions,
    outgoing,
    travelling,
    type_name,
)
from nmbus.errors import ConfigurationError
from nmbus.messages import Envelope, Message
from nmbus.telemetry.tracer import NULL_TRACER, Tracer

if TYPE_CHECKING:
    import asyncpg

    from nmbus.ports.store import HandlerTransaction
    from nmbus.received import Received


@dataclass(slots=True)
class Effects:
    """What one handler run did besides returning, for the worker to act on.

    ``sends`` are ``(queue, envelope)`` and ``publishes`` envelopes, stored when
    the batch commits and only if the handler succeeded. ``savepoint`` says the
    handler touched the connection (a savepoint was taken); ``tainted`` that a
    statement failed on it or ``raw()`` handed it out, so the savepoint may be
    aborted and must be released (or rolled back) before the next handler.
    ``note``: why a message that succeeded did nothing (a stale saga timeout),
    stored as its ``error_info`` in X. ``undo``: what takes back the handler's
    changes held in memory (saga states) if the message fails, as the rollback
    of its savepoint takes back its writes; run last first.
    """

    sends: list[tuple[str, Envelope]] = field(default_factory=list)
    publishes: list[Envelope] = field(default_factory=list)
    savepoint: bool = False
    tainted: bool = False
    note: str | None = None
    undo: list[Callable[[], None]] = field(default_factory=list)


class HandlerConnection:
    """The worker's connection, as a handler sees it.

    It is the connection of the batch's transaction. The first time a handler
    uses it, a savepoint is taken, so a failing handler rolls back only its own
    writes; handlers that never touch it cost no savepoint at all. Every
    coroutine method of ``asyncpg.Connection`` is available.
    """

    __slots__ = ("_batch", "_effects")

    def __init__(self, effects: Effects, batch: HandlerTransaction) -> None:
        self._effects = effects
        self._batch = batch

    async def _enter(self) -> asyncpg.Connection:
        if not self._effects.savepoint:
            await self._batch.savepoint()
            self._effects.savepoint = True
        conn: asyncpg.Connection = self._batch.connection
        return conn

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        conn = await self._enter()
        try:
            return await getattr(conn, method)(*args, **kwargs)
        except BaseException:
            # The transaction may now be aborted: the worker must find out at once.
            self._effects.tainted = True
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

    async def hold(self) -> None:
        """Take the handler's savepoint now, without a statement of its own."""
        await self._enter()

    async def raw(self) -> asyncpg.Connection:
        """The underlying asyncpg connection, with the handler's savepoint taken."""
        # What happens on it is unknown to us: treat its savepoint as possibly aborted.
        self._effects.tainted = True
        return await self._enter()


class SagaControl:
    """``ctx.saga`` in a saga handler: which saga, its timeouts, its completion."""

    __slots__ = ("_ctx", "completed", "instance", "key", "name")

    def __init__(self, ctx: Context, name: str, key: str, instance: str) -> None:
        self._ctx = ctx
        self.name = name
        self.key = key
        #: This life of the saga: a saga completed and started again with the same
        #: key is another instance, which the first one's timeouts do not touch.
        self.instance = instance
        self.completed = False

    async def timeout(self, seconds: float, message: Message) -> str:
        """Send ``message`` to this endpoint in ``seconds``, for this saga's handler of its type.

        It is an ordinary deferred message (in R until due) carrying the saga's
        name, key and instance in headers, stored when the handler's transaction
        commits. It acts on this saga instance only: once the saga has
        completed (even if started again with the same key) it goes to X
        without running, with a note in its ``error_info``. Returns its unique id.
        """
        marks = {
            SAGA_HEADER: self.name,
            SAGA_KEY_HEADER: self.key,
            SAGA_INSTANCE_HEADER: self.instance,
        }
        options = outgoing({"delay": seconds}).marked(marks)
        return await self._ctx._send(message, self._ctx.queue, options)

    def complete(self) -> None:
        """End the saga: its row is deleted when the handler's transaction commits."""
        self.completed = True


class Context:
    """Everything a handler knows about the message it handles."""

    __slots__ = (
        "_batch",
        "_builder",
        "_connection",
        "_received",
        "_row",
        "_saga",
        "_tracer",
        "_travel",
        "effects_made",
        "queue",
    )

    def __init__(
        self,
        queue: str,
        received: Received,
        batch: HandlerTransaction,
        builder: EnvelopeBuilder,
        tracer: Tracer = NULL_TRACER,
    ) -> None:
        self.queue = queue
        self._tracer = tracer
        self._received = received
        self._row = received.row
        self._batch = batch
        self._builder = builder
        #: The handler's :class:`Effects`, or None while it has done nothing that
        #: made one (most handlers send and write nothing: they cost no Effects).
        #: A plain attribute, read once or twice per message by the dispatcher.
        self.effects_made: Effects | None = None
        self._connection: HandlerConnection | None = None
        self._saga: SagaControl | None = None
        self._travel: dict[str, str] | None = None

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
    def group(self) -> str | None:
        """The group the message was sent with (``send(..., group=...)``), or None."""
        return self._received.headers.get(GROUP_HEADER)

    @property
    def headers(self) -> Mapping[str, str]:
        # Parsed once per message (Received), whoever reads them first. Written by
        # hand, msg_headers may hold any JSON: only an object is headers.
        return self._received.headers

    @property
    def effects(self) -> Effects:
        """What this handler did besides returning: made when it first does something."""
        effects = self.effects_made
        if effects is None:
            effects = self.effects_made = Effects()
        return effects

    @property
    def saga(self) -> SagaControl:
        """The saga of the saga handler running now (timeouts, completion)."""
        if self._saga is None:
            raise ConfigurationError("ctx.saga is only available in a saga handler")
        return self._saga

    def use_saga(self, control: SagaControl | None) -> None:
        """Set (or clear) what ``ctx.saga`` is: called around each saga handler."""
        self._saga = control

    @property
    def received(self) -> Received:
        """The claimed row as the worker decoded it (its saga states, for a saga handler)."""
        return self._received

    async def hold_connection(self) -> None:
        """With handlers of the batch running at once, keep the batch's connection
        from now until this handler is done (taking its savepoint), so that no
        other handler's savepoint and no partial commit of the batch comes in
        between; a handler that runs alone holds it anyway, and pays nothing here.
        """
        if getattr(self._batch, "shared", False):
            await self.connection.hold()

    @property
    def connection(self) -> HandlerConnection:
        """The connection of the transaction this message is handled in."""
        if self._connection is None:
            self._connection = HandlerConnection(self.effects, self._batch)
        return self._connection

    def outgoing_headers(self, headers: Mapping[str, str] | None) -> Mapping[str, str] | None:
        """The headers of what this handler sends: the travelling ones, overridden by ``headers``.

        Every header of the message being handled travels except nmbus's own
        (``nmbus-*``: type chain, saga, reply address); see docs/request-reply.md.
        """
        if self._travel is None:
            self._travel = travelling(self.headers) if self._row.msg_headers else {}
        if not self._travel:
            return headers
        if not headers:
            return self._travel
        return {**self._travel, **headers}

    def _own(self, options: Outgoing) -> Outgoing:
        """What this handler sends carries its travelling headers and its correlation id."""
        headers = self.outgoing_headers(options.headers)
        correlation = options.correlation_id or self.correlation_id or self.unique_id
        if headers is options.headers and correlation == options.correlation_id:
            return options
        return replace(options, headers=headers, correlation_id=correlation)

    async def send(self, message: Message, to: str, **options: Unpack[SendOptions]) -> str:
        """Send ``message`` to queue ``to`` when this handler's transaction commits.

        It carries this message's correlation id and travelling headers unless
        ``correlation_id`` / ``headers`` say otherwise. The options are
        ``Bus.send``'s (``reply_to``, ``priority``, ``sequence``, ``ttl``,
        ``expires_at``, ``group``...), which also says what is refused.
        """
        return await self._send(message, to, outgoing(options))

    async def _send(self, message: Message, to: str, options: Outgoing) -> str:
        """``send`` with its options checked (a reply and a saga timeout add nmbus's headers)."""
        # Recorded now, stored when the batch commits. The current span (this
        # handler's) wins over the traceparent the handled message carried in.
        builder = self._builder
        with self._tracer.producing("send", to) as producer:
            traced = self._own(options.with_headers(producer.headers(options.headers)))
            if builder.hooks:
                traced = await builder.hooked(message, traced)
            envelope = builder.for_send(message, to, traced)
            producer.sent(envelope)
        self.effects.sends.append((to, envelope))
        return envelope.unique_id

    async def publish(self, message: Message, **options: Unpack[PublishOptions]) -> str:
        """Publish ``message`` to every subscriber, in this handler's transaction.

        The copies are stored when the handler succeeds, with the batch's
        commit (one server call for everything the batch published), and carry
        this message's correlation id and travelling headers (unless
        ``correlation_id`` / ``headers`` say otherwise). The options are
        ``Bus.publish``'s. Returns the publish id: each copy's unique_id is
        ``<publish id>/<subscriber>``.
        """
        checked = outgoing(options, "publish")
        builder = self._builder
        with self._tracer.producing("publish", type_name(message)) as producer:
            traced = self._own(checked.with_headers(producer.headers(checked.headers)))
            if builder.hooks:
                traced = await builder.hooked(message, traced)
            envelope, _ = builder.for_publish(message, traced)
            producer.sent(envelope)
        self.effects.publishes.append(envelope)
        return envelope.unique_id

    async def reply(self, message: Message, *, headers: Mapping[str, str] | None = None) -> str:
        """Answer the message being handled, when this handler's transaction commits.

        The reply goes to the endpoint its ``reply-to`` header names (set by
        ``bus.request`` or ``send(..., reply_to=...)``), else to the endpoint
        that sent it; it carries the same correlation id, which is how a
        waiting ``bus.request`` recognises its answer.
        """
        request = self.headers
        to = request.get(REPLY_TO_HEADER) or self.from_endpoint
        marks = {IN_REPLY_TO_HEADER: self.unique_id}
        for name in (REQUESTER_HEADER, REPLY_BY_HEADER):
            value = request.get(name)
            if isinstance(value, str):
                marks[name] = value
        return await self._send(message, to, outgoing({"headers": headers}).marked(marks))
