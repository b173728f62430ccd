"""Sending: what an endpoint puts into queues, whether it runs workers or not.

``send`` stores one message in one queue, ``publish`` and ``publish_many``
store a copy in the queue of every subscriber, ``request`` sends and waits for
the reply. Each goes Bus -> EnvelopeBuilder (every check, before anything is
written) -> Store, through the tracer (a PRODUCER span while tracing is on).

These are methods of :class:`~nmbus.Bus` (this class is its base), kept in
their own module; the Bus sets the attributes named here.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Unpack

import structlog

from nmbus.delivery.cancellation import Cancel
from nmbus.delivery.replies import Replies
from nmbus.envelopes import (
    REPLY_BY_HEADER,
    REPLY_TO_HEADER,
    REQUESTER_HEADER,
    EnvelopeBuilder,
    Outgoing,
    PublishOptions,
    SendOptions,
    check_connection,
    outgoing,
    type_name,
    user_headers,
)
from nmbus.errors import MAX_SECONDS, ConfigurationError
from nmbus.messages import Message
from nmbus.names import validate_queue_name
from nmbus.ports.store import Store
from nmbus.settings import Settings
from nmbus.telemetry.tracer import tracer_of

if TYPE_CHECKING:
    from nmbus.telemetry.tracing import Tracing

log = structlog.get_logger("nmbus.bus")


class Sending:
    """The sending side of a Bus: ``send``, ``request``, ``publish(_many)``, ``cancel``."""

    endpoint: str
    settings: Settings
    store: Store
    envelopes: EnvelopeBuilder
    tracing: Tracing | None
    replies: Replies
    client_id: str
    # Whether the bus runs (a request needs its workers to receive the reply).
    _started: bool
    _stopped: asyncio.Event

    async def send(
        self, message: Message, to: str, *, connection: Any = None, **options: Unpack[SendOptions]
    ) -> str:
        """Store ``message`` in queue ``to``; durable when this returns.

        With ``deliver_at`` (timezone-aware) or ``delay`` (seconds) it lands in
        R until then. With ``connection``, an asyncpg connection inside a
        transaction, the message exists exactly when that transaction commits.
        A ``unique_id`` already stored in that queue is not stored again;
        ``unique_while="pending"`` holds it only while its message waits, and
        ``unique_for`` (seconds) only that long after the first send
        (docs/messages.md, "Unique windows"; a wrong one is InvalidMessage).
        A queue that no endpoint has created (its endpoint never started in this
        database: a typo?) is created, marked and logged once
        (``queue_created_by_send``); with ``create_queues=False``
        (NMBUS_CREATE_QUEUES=false) the send is refused with QueueNotFound
        instead (docs/operations.md).
        ``reply_to`` names the endpoint the receiver's ``ctx.reply`` answers
        to (default: this one). ``priority`` (-100..100, higher first),
        ``sequence`` (members of one key are handled one at a time, in send
        order) and ``ttl`` seconds or ``expires_at`` (never handled after it)
        are described in docs/delivery.md. ``group`` (a key of at most 200
        UTF-8 bytes, such as a tenant) is what the receiver's
        ``group_concurrency`` limits count per (docs/flow-control.md); the
        handler reads it as ``ctx.group``. Returns the message's unique id.

        Refused with InvalidMessage, before anything is written: headers that
        are not a mapping of str to str or that use nmbus's own names
        (``nmbus-*``), a ``unique_id`` or ``correlation_id`` that is not a str of
        at most 1,000 UTF-8 bytes, a ``connection`` that is not an asyncpg
        connection; MessageTooLarge when body and headers together exceed
        ``max_message_bytes``.
        """
        return await self._send(message, to, outgoing(options), connection)

    async def _send(
        self, message: Message, to: str, options: Outgoing, connection: Any = None
    ) -> str:
        """``send`` with its options checked (``request`` adds nmbus's own headers)."""
        check_connection(connection)
        builder = self.envelopes
        with tracer_of(self.tracing).producing("send", to) as producer:
            traced = options.with_headers(producer.headers(options.headers))
            if builder.hooks:
                traced = await builder.hooked(message, traced)
            envelope = builder.for_send(message, to, traced)
            producer.sent(envelope)
            await self.store.insert(to, self.endpoint, [envelope], connection)
        return envelope.unique_id

    async def request(
        self,
        message: Message,
        to: str,
        *,
        timeout: float = 30.0,
        headers: Mapping[str, str] | None = None,
    ) -> Message:
        """Send ``message`` to ``to`` and return the reply its handler sends with ``ctx.reply``.

        The request carries a fresh correlation id and this endpoint as its
        reply address; the reply comes back to this endpoint's queue, where
        this process's workers hand it to the waiting call (so the bus must run
        workers: concurrency >= 1). Raises TimeoutError after ``timeout``
        seconds; a reply that comes later is handled like any message (its
        handler, or X with a note). Many requests may be in flight at once.
        """
        if not (isinstance(timeout, int | float) and math.isfinite(timeout)):
            raise ConfigurationError(f"request timeout must be a finite number, got {timeout!r}")
        if not 0 < timeout <= MAX_SECONDS:
            raise ConfigurationError(f"request timeout must be > 0 seconds, got {timeout}")
        if self.settings.concurrency < 1:
            raise ConfigurationError(
                f"bus.request needs endpoint {self.endpoint!r} to run workers (concurrency >= 1): "
                "the reply comes back to its queue and is received by them"
            )
        if not self._started or self._stopped.is_set():
            raise RuntimeError(f"bus {self.endpoint!r} is not running; use 'async with bus:'")
        headers = user_headers(headers)
        correlation_id = uuid.uuid4().hex
        reply_by = datetime.now(UTC) + timedelta(seconds=timeout)
        marks = {
            REPLY_TO_HEADER: self.endpoint,
            REQUESTER_HEADER: self.client_id,
            REPLY_BY_HEADER: reply_by.isoformat(),
        }
        future = self.replies.expect(correlation_id)
        try:
            options = outgoing({"headers": headers, "correlation_id": correlation_id})
            await self._send(message, to, options.marked(marks))
            try:
                async with asyncio.timeout(timeout):
                    return await future
            except TimeoutError:
                raise TimeoutError(
                    f"no reply from {to!r} to {message.__type_name__} within {timeout:g}s "
                    f"(correlation id {correlation_id})"
                ) from None
        finally:
            self.replies.forget(correlation_id)

    async def publish(
        self, message: Message, *, connection: Any = None, **options: Unpack[PublishOptions]
    ) -> list[str]:
        """Store a copy of ``message`` in the queue of every live subscriber, all or none.

        One round trip whatever the number of subscribers. Every copy carries
        the same correlation id (``correlation_id``, else the publish id) and
        its own unique_id, ``<publish id>/<subscriber>``; the publish id is
        ``unique_id`` when given, so publishing the same id again stores nothing
        new. With ``connection`` (asyncpg, in a transaction) the copies exist
        exactly when that transaction commits. ``priority``, ``sequence``, ``ttl``
        and ``expires_at`` apply to every copy; a sequence keeps its order in each
        subscriber's queue. Returns the subscriber endpoints. Refused as ``send``
        refuses (headers, ids, connection, size).
        """
        checked = outgoing(options, "publish")
        check_connection(connection)
        builder = self.envelopes
        with tracer_of(self.tracing).producing("publish", type_name(message)) as producer:
            traced = checked.with_headers(producer.headers(checked.headers))
            if builder.hooks:
                traced = await builder.hooked(message, traced)
            envelope, chain = builder.for_publish(message, traced)
            producer.sent(envelope)
            copies = await self.store.publish(self.endpoint, [envelope], [chain], connection)
        self._log_published(1, copies)
        return sorted(copies)

    async def publish_many(
        self,
        messages: Sequence[Message],
        *,
        headers: Mapping[str, str] | None = None,
        correlation_id: str | None = None,
        connection: Any = None,
    ) -> dict[str, int]:
        """Publish many messages in one round trip and one transaction.

        Each message gets its own publish id and (unless ``correlation_id`` is
        given) its own correlation id. Returns copies stored per subscriber.
        """
        if not messages:
            return {}
        headers = user_headers(headers)
        check_connection(connection)
        # One span for the batch: every message carries its context.
        name = type_name(messages[0]) if len(messages) == 1 else "messages"
        with tracer_of(self.tracing).producing("publish", name, len(messages)) as producer:
            copies = await self._publish_many(
                messages, producer.headers(headers), correlation_id, connection
            )
        self._log_published(len(messages), copies)
        return copies

    async def _publish_many(
        self,
        messages: Sequence[Message],
        headers: Mapping[str, str] | None,
        correlation_id: str | None,
        connection: Any,
    ) -> dict[str, int]:
        builder = self.envelopes
        options = Outgoing(headers, correlation_id=correlation_id)
        if builder.hooks:
            pairs = [builder.for_publish(m, await builder.hooked(m, options)) for m in messages]
        else:
            pairs = [builder.for_publish(m, options) for m in messages]
        envelopes = [envelope for envelope, _ in pairs]
        return await self.store.publish(
            self.endpoint, envelopes, [chain for _, chain in pairs], connection
        )

    def _log_published(self, count: int, copies: Mapping[str, int]) -> None:
        if not copies:
            log.info("published_without_subscribers", queue=self.endpoint, messages=count)
        else:
            log.debug("published", queue=self.endpoint, messages=count, copies=dict(copies))

    async def cancel(
        self, queue: str, *, unique_id: str | None = None, correlation_id: str | None = None
    ) -> int:
        """Cancel messages in ``queue`` that have not started; returns how many.

        Say which: the message of ``unique_id``, or every message of
        ``correlation_id``. Each one waiting (I or R) that no worker holds goes
        to F with ``error_info`` starting ``Cancelled``, in one statement, so it
        never runs and stays visible; requeue it to run it after all. A message
        running or done is not touched, nor counted; one claimed but not yet
        started runs. Cancelling the same message again counts 0.
        """
        request = Cancel.of(unique_id, correlation_id)
        cancelled = await self.store.cancel(validate_queue_name(queue), request)
        log.debug("cancelled", queue=queue, messages=cancelled)
        return cancelled
