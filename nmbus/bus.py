"""The Bus: one endpoint, its queue table, its handlers, subscriptions and workers."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, overload

import structlog

from nmbus.errors import ConfigurationError, MessageTooLarge, StoreError
from nmbus.handlers import HandlerFunc, Registry
from nmbus.messages import Envelope, Message, type_chain, type_name
from nmbus.retry import RetryPolicy
from nmbus.settings import Settings
from nmbus.store import Store, validate_queue_name
from nmbus.worker import Worker

if TYPE_CHECKING:
    from nmbus.store import Batch

log = structlog.get_logger("nmbus.bus")

F = TypeVar("F", bound=HandlerFunc)


class Bus:
    """An endpoint of the bus: its name is its queue table.

    ``async with bus:`` creates the tables, registers subscriptions and starts
    ``settings.concurrency`` worker loops (0 for a send-only process).
    """

    def __init__(
        self,
        endpoint: str,
        dsn: str | None = None,
        *,
        settings: Settings | None = None,
        store: Store | None = None,
        retry: RetryPolicy | int | None = None,
        **overrides: Any,
    ) -> None:
        self.endpoint = validate_queue_name(endpoint)
        if settings is None:
            given = {k: v for k, v in overrides.items() if v is not None}
            if dsn is not None:
                given["dsn"] = dsn
            settings = Settings(**given)
        elif dsn is not None or overrides:
            settings = settings.model_copy(
                update={**overrides, **({"dsn": dsn} if dsn is not None else {})}
            )
        self.settings = settings
        if store is None:
            if not settings.dsn:
                raise ConfigurationError(
                    "no database: pass Bus(..., dsn='postgresql://...') or set NMBUS_DSN"
                )
            from nmbus.postgres import PostgresStore

            store = PostgresStore(settings.dsn, settings.schema_name, settings.send_pool_size)
        self.store: Store = store
        self.registry = Registry()
        self.retry = RetryPolicy.of(
            retry,
            RetryPolicy(
                max_attempts=settings.max_attempts,
                initial_delay=settings.retry_delay,
                max_delay=max(settings.retry_max_delay, settings.retry_delay),
            ),
        )
        self.client_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._subscriptions: dict[tuple[str, str], type[Message]] = {}
        self.worker = Worker(self)
        self._background: list[asyncio.Task[None]] = []
        self._started = False
        self._stopped = asyncio.Event()

    # -- registration ------------------------------------------------------------

    @overload
    def handler(self, func: F, /) -> F: ...

    @overload
    def handler(
        self,
        message: type[Message] | None = None,
        /,
        *,
        retry: RetryPolicy | int | None = None,
        timeout: float | None = None,
    ) -> Callable[[F], F]: ...

    def handler(
        self,
        target: Any = None,
        /,
        *,
        retry: RetryPolicy | int | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Register an async handler; the message type comes from its annotation.

        ``@bus.handler``, ``@bus.handler(retry=3, timeout=10)`` or
        ``@bus.handler(SomeMessage)`` all work.
        """
        if target is not None and not isinstance(target, type):
            self.registry.add(target, None, retry, timeout)
            return target
        message_type = target

        def register(func: F) -> F:
            self.registry.add(func, message_type, retry, timeout)
            return func

        return register

    def subscribe(self, message_type: type[Message], publisher: str) -> None:
        """Receive ``message_type`` (and its subclasses) published by ``publisher``."""
        if not (isinstance(message_type, type) and issubclass(message_type, Message)):
            raise ConfigurationError(f"subscribe() needs a Message subclass, got {message_type!r}")
        validate_queue_name(publisher)
        self._subscriptions[(publisher, type_name(message_type))] = message_type

    async def unsubscribe(self, message_type: type[Message], publisher: str) -> None:
        """Stop receiving ``message_type`` from ``publisher``, now and after restarts."""
        self._subscriptions.pop((publisher, type_name(message_type)), None)
        await self.store.unsubscribe(publisher, self.endpoint, [type_name(message_type)])

    # -- life cycle ----------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            raise RuntimeError(f"bus {self.endpoint!r} is already started")
        self._started = True
        await self.store.open()
        try:
            await self.store.ensure_queue(self.endpoint)
            await self._renew_subscriptions()
        except BaseException:
            await self.store.close()
            raise
        if self._subscriptions and self.settings.subscription_ttl is not None:
            self._spawn(self._subscription_renewer(), "subscriptions")
        if self.settings.concurrency > 0:
            if not len(self.registry):
                log.warning("bus_without_handlers", queue=self.endpoint)
            self._spawn(self.store.listen(self._on_wakeup), "listener")
            self._spawn(self._lease_renewer(), "leases")
            self.worker.start()
        log.info(
            "bus_started",
            queue=self.endpoint,
            concurrency=self.settings.concurrency,
            handlers=len(self.registry),
            subscriptions=len(self._subscriptions),
        )

    async def stop(self) -> None:
        """Graceful shutdown: finish in-flight handlers, return unstarted messages to I."""
        if not self._started or self._stopped.is_set():
            return
        try:
            await self.worker.stop()
        finally:
            for task in self._background:
                task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            self._background.clear()
            await self.store.close()
            self._stopped.set()
            log.info("bus_stopped", queue=self.endpoint, handled=self.worker.handled)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def __aenter__(self) -> Bus:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.shield(self.stop())

    def _spawn(self, coro: Any, name: str) -> None:
        self._background.append(asyncio.create_task(coro, name=f"nmbus-{self.endpoint}-{name}"))

    def _on_wakeup(self, queue: str) -> None:
        if queue == self.endpoint or queue == "*":
            self.worker.wake()

    async def _lease_renewer(self) -> None:
        interval = self.settings.lease_seconds / 3
        while True:
            await asyncio.sleep(interval)
            ids = list(self.worker.in_flight)
            if not ids:
                continue
            try:
                await self.store.renew_leases(
                    self.endpoint, ids, self.client_id, self.settings.lease_seconds
                )
            except StoreError as exc:
                log.warning("lease_renewal_failed", queue=self.endpoint, error=str(exc))

    async def _renew_subscriptions(self) -> None:
        by_publisher: dict[str, list[str]] = {}
        for publisher, name in self._subscriptions:
            by_publisher.setdefault(publisher, []).append(name)
        for publisher, names in by_publisher.items():
            await self.store.subscribe(
                publisher, self.endpoint, sorted(names), self.settings.subscription_ttl
            )

    async def _subscription_renewer(self) -> None:
        assert self.settings.subscription_ttl is not None
        interval = self.settings.subscription_ttl / 3
        while True:
            await asyncio.sleep(interval)
            try:
                await self._renew_subscriptions()
            except StoreError as exc:
                log.warning("subscription_renewal_failed", queue=self.endpoint, error=str(exc))

    # -- sending ---------------------------------------------------------------------

    async def send(
        self,
        message: Message,
        to: str,
        *,
        deliver_at: datetime | None = None,
        delay: float | None = None,
        headers: Mapping[str, str] | None = None,
        unique_id: str | None = None,
        correlation_id: str | None = None,
        connection: Any = None,
    ) -> str:
        """Store ``message`` in queue ``to``; durable when this returns.

        With ``deliver_at`` (timezone-aware) or ``delay`` (seconds) it lands in
        R until then. With ``connection``, an asyncpg connection inside a
        transaction, the message exists exactly when that transaction commits.
        A ``unique_id`` already stored in that queue is not stored again.
        Returns the message's unique id.
        """
        self._check_queue(to)
        envelope = self._envelope(
            message,
            correlation_id=correlation_id,
            headers=headers,
            unique_id=unique_id,
            deliver_at=self._deliver_time(deliver_at, delay),
        )
        await self.store.insert(to, self.endpoint, [envelope], connection)
        return envelope.unique_id

    async def publish(
        self,
        message: Message,
        *,
        headers: Mapping[str, str] | None = None,
        correlation_id: str | None = None,
        connection: Any = None,
    ) -> list[str]:
        """Send a copy of ``message`` to every live subscriber's queue, all or none.

        Returns the subscriber endpoints. With ``connection`` the copies are
        written in the caller's transaction.
        """
        types = type_chain(type(message))
        correlation = correlation_id or uuid.uuid4().hex
        if connection is not None:
            return await self._publish_on(connection, message, types, headers, correlation)
        pool = getattr(self.store, "pool", None)
        if pool is None:
            subscribers = await self.store.subscribers(self.endpoint, types)
            for queue in subscribers:
                envelope = self._envelope(message, correlation, headers, None)
                await self.store.insert(queue, self.endpoint, [envelope])
            self._log_published(message, subscribers)
            return subscribers
        from nmbus.postgres.errors import wrap_errors

        # Acquiring a pooled connection and BEGIN talk to the server too: an outage
        # there must surface as DatabaseUnavailable, like every other send.
        with wrap_errors("publish"):
            async with pool.acquire() as conn, conn.transaction():
                return await self._publish_on(conn, message, types, headers, correlation)

    async def _publish_on(
        self,
        connection: Any,
        message: Message,
        types: tuple[str, ...],
        headers: Mapping[str, str] | None,
        correlation: str,
    ) -> list[str]:
        subscribers = await self.store.subscribers(self.endpoint, types, connection)
        for queue in subscribers:
            envelope = self._envelope(message, correlation, headers, None)
            await self.store.insert(queue, self.endpoint, [envelope], connection)
        self._log_published(message, subscribers)
        return subscribers

    def _log_published(self, message: Message, subscribers: list[str]) -> None:
        if not subscribers:
            log.info("published_without_subscribers", message_type=type_name(type(message)))

    async def _subscribers_for(self, message: Message, batch: Batch) -> list[str]:
        return await batch.subscribers(self.endpoint, type_chain(type(message)))

    # -- envelopes -------------------------------------------------------------------

    def _check_queue(self, to: str) -> None:
        validate_queue_name(to)

    def _deliver_time(self, deliver_at: datetime | None, delay: float | None) -> datetime | None:
        if deliver_at is not None and delay is not None:
            raise ValueError("give deliver_at or delay, not both")
        if delay is not None:
            if delay < 0:
                raise ValueError(f"delay must be >= 0 seconds, got {delay}")
            return datetime.now(UTC) + timedelta(seconds=delay) if delay else None
        if deliver_at is not None and deliver_at.tzinfo is None:
            raise ValueError("deliver_at must be timezone-aware (e.g. datetime.now(UTC))")
        return deliver_at

    def _envelope(
        self,
        message: Message,
        correlation_id: str | None,
        headers: Mapping[str, str] | None,
        unique_id: str | None,
        deliver_at: datetime | None = None,
    ) -> Envelope:
        if not isinstance(message, Message):
            raise TypeError(f"expected a nmbus.Message, got {type(message).__name__}")
        text = message.model_dump_json()
        limit = self.settings.max_message_bytes
        if len(text) * 4 > limit and len(text.encode()) > limit:
            raise MessageTooLarge(
                f"{type_name(type(message))} is {len(text.encode())} bytes serialized, over "
                f"the limit of {limit} (NMBUS_MAX_MESSAGE_BYTES)"
            )
        header_text = None
        if headers:
            for key, value in headers.items():
                if not isinstance(key, str) or not isinstance(value, str):
                    raise TypeError("headers must map str to str")
                if "\x00" in key or "\x00" in value:
                    # PostgreSQL's jsonb cannot hold U+0000; refuse it here, clearly.
                    raise ValueError(f"header {key!r} contains a NUL character (U+0000)")
            header_text = json.dumps(dict(headers), ensure_ascii=False)
        if unique_id is not None and (not isinstance(unique_id, str) or not unique_id):
            raise ValueError("unique_id must be a non-empty string")
        uid = unique_id or uuid.uuid4().hex
        return Envelope(
            label=type_name(type(message)),
            msg_text=text,
            msg_headers=header_text,
            unique_id=uid,
            correlation_id=correlation_id or uid,
            deliver_at=deliver_at,
        )
