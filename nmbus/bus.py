"""The Bus: one endpoint, its queue table, its handlers, subscriptions and workers.

The Bus is the composition root: it builds the settings, the store, the
handler registry, the envelope builder and the Worker, wires them together,
and runs their life cycle. Sending goes Bus -> EnvelopeBuilder -> Store;
handling goes Worker -> Dispatcher -> handlers; nothing below calls back up.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import socket
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

import structlog

from nmbus.dispatch import Dispatcher
from nmbus.envelopes import (
    REPLY_BY_HEADER,
    REPLY_TO_HEADER,
    REQUESTER_HEADER,
    EnvelopeBuilder,
    deliver_time,
    delivery,
)
from nmbus.errors import MAX_SECONDS, ConfigurationError
from nmbus.handlers import HandlerFunc, Registry
from nmbus.logs import log_failure
from nmbus.messages import Message
from nmbus.periodic import Schedule, Scheduler, Tick, TickHandler, router
from nmbus.replies import Replies
from nmbus.retry import RetryPolicy
from nmbus.sagas import S, Saga
from nmbus.settings import Settings, build_settings
from nmbus.store import Store, validate_queue_name
from nmbus.subscriptions import Subscriptions
from nmbus.supervise import supervise
from nmbus.worker import Worker

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
        dead_letter: str | None = None,
        **overrides: Any,
    ) -> None:
        self.endpoint = validate_queue_name(endpoint)
        # The failure port (docs/delivery.md): a copy of every message that lands in F.
        self.dead_letter = validate_queue_name(dead_letter) if dead_letter is not None else None
        # Validated in both cases: a value that would break at run time
        # (inf, NaN, a negative age) is refused here, as InvalidSetting.
        if settings is None:
            given = {k: v for k, v in overrides.items() if v is not None}
            if dsn is not None:
                given["dsn"] = dsn
            settings = build_settings(**given)
        elif dsn is not None or overrides:
            settings = build_settings(
                settings, **overrides, **({"dsn": dsn} if dsn is not None else {})
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
        self.subscriptions = Subscriptions(self.endpoint, store, settings)
        self.envelopes = EnvelopeBuilder(settings.max_message_bytes)
        self.replies = Replies(self.client_id)
        self.worker = Worker(
            queue=self.endpoint,
            store=store,
            dispatcher=Dispatcher(
                self.endpoint, self.registry, self.retry, settings, self.envelopes, self.replies
            ),
            settings=settings,
            client_id=self.client_id,
            dead_letter=self.dead_letter,
        )
        self.sagas: dict[str, Saga[Any]] = {}
        self._schedules: dict[str, Schedule] = {}
        self._background: list[asyncio.Task[None]] = []
        self._started = False
        self._stopped = asyncio.Event()

    def __repr__(self) -> str:
        return f"<Bus {self.endpoint!r} store={self.store!r}>"

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

    def saga(
        self,
        state: type[S],
        key: str | Callable[[Any], object],
        *,
        name: str | None = None,
        on_missing: str = "fail",
    ) -> Saga[S]:
        """Declare a saga whose state is the pydantic model ``state``, kept in this endpoint.

        ``key`` names the field of its messages that identifies one saga (or is
        a callable of the message). ``name`` (default: the model's class name)
        is what the saga table stores; two sagas of an endpoint need two names.
        ``on_missing="ignore"`` sends a non-start message for a missing saga
        to X instead of F. Register handlers with ``@saga.handler``.
        """
        saga_name = name if name is not None else state.__name__
        if saga_name in self.sagas:
            raise ConfigurationError(
                f"endpoint {self.endpoint!r} already has a saga named {saga_name!r}; "
                "give this one name=..."
            )
        saga = Saga(
            state,
            key,
            name=saga_name,
            endpoint=self.endpoint,
            registry=self.registry,
            store=self.store,
            on_missing=on_missing,
        )
        self.sagas[saga_name] = saga
        return saga

    def periodic(
        self,
        *,
        every: float | None = None,
        cron: str | None = None,
        name: str | None = None,
        missed: Literal["last", "skip"] = "last",
    ) -> Callable[[TickHandler], TickHandler]:
        """Register ``async def handler(tick: Tick, ctx)``, run once per due time.

        ``every`` seconds (due at multiples of it since the epoch) or ``cron``
        (five fields, or six with seconds last; UTC). However many processes
        run this endpoint, each due time's tick is stored once (its unique id is
        the schedule's ``name``, default the function's name, plus the due time)
        and handled like any message of the endpoint. After downtime,
        ``missed="last"`` enqueues the latest missed due time once;
        ``missed="skip"`` waits for the next one. See docs/delivery.md.
        """

        def register(func: TickHandler) -> TickHandler:
            if self._started:
                raise ConfigurationError("register periodic handlers before the bus starts")
            schedule = Schedule.of(func, every, cron, name, missed)
            if schedule.name in self._schedules:
                raise ConfigurationError(
                    f"periodic schedule {schedule.name!r} is registered twice; give name=..."
                )
            if not self._schedules:
                self.registry.add(router(self._schedules), Tick)
            self._schedules[schedule.name] = schedule
            return func

        return register

    def subscribe(
        self, message_type: type[Message], publisher: str, *, permanent: bool = False
    ) -> None:
        """Receive ``message_type`` (and its subclasses) published by endpoint ``publisher``.

        Declare it before the bus starts; ``async with bus:`` writes the
        subscription, which expires ``settings.subscription_ttl`` seconds after
        the last renewal (renewed every ttl/3 while the bus runs). With
        ``permanent=True`` (or ``subscription_ttl=None``) it never expires and
        only :meth:`unsubscribe` removes it.
        """
        self.subscriptions.add(message_type, publisher, permanent)

    async def unsubscribe(self, message_type: type[Message], publisher: str) -> None:
        """Stop receiving ``message_type`` from ``publisher``: delete the subscription rows.

        Before start, the rows are deleted when the bus starts.
        """
        await self.subscriptions.remove(message_type, publisher)

    # -- life cycle ----------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            raise RuntimeError(f"bus {self.endpoint!r} is already started")
        self._started = True
        await self.store.open()
        try:
            await self.store.ensure_queue(self.endpoint)
            if self.sagas:
                await self.store.ensure_sagas(self.endpoint)
            await self.subscriptions.start()
        except BaseException:
            await self.store.close()
            raise
        if self.subscriptions.renewing:
            self._spawn(self.subscriptions.run_renewer, "subscriptions")
        if self.settings.concurrency > 0:
            if not len(self.registry):
                log.warning("bus_without_handlers", queue=self.endpoint)
            interval = self.settings.retention_interval
            if interval is not None:
                self._spawn(lambda: self._retention(interval), "retention")
            if self._schedules:
                scheduler = Scheduler(
                    self.endpoint, self.store, self.envelopes, list(self._schedules.values())
                )
                self._spawn(scheduler.run, "periodic")
            self.worker.start()
        log.info(
            "bus_started",
            queue=self.endpoint,
            concurrency=self.settings.concurrency,
            handlers=len(self.registry),
            subscriptions=len(self.subscriptions),
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

    def _spawn(self, run: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        """Run a side task of the bus, supervised: logged and restarted whenever it dies."""
        side = supervise(run, name, log, self.settings.reconnect_max_delay, queue=self.endpoint)
        self._background.append(asyncio.create_task(side, name=f"nmbus-{self.endpoint}-{name}"))

    async def _retention(self, interval: float) -> None:
        """Clean this endpoint's queue every ``interval`` seconds (NMBUS_RETENTION_INTERVAL).

        Each worker process does it for its own queue; a per-queue advisory lock
        makes concurrent runs skip, so many workers cost nothing extra.
        """
        while True:
            # Spread the runs of many workers started together.
            await asyncio.sleep(interval * random.uniform(0.5, 1.0))
            try:
                await self.store.apply_retention(self.endpoint, self.settings)
            except Exception as exc:
                log_failure(log, "retention_failed", exc, "warning", queue=self.endpoint)

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
        reply_to: str | None = None,
        priority: int = 0,
        sequence: str | None = None,
        ttl: float | None = None,
        expires_at: datetime | None = None,
    ) -> str:
        """Store ``message`` in queue ``to``; durable when this returns.

        With ``deliver_at`` (timezone-aware) or ``delay`` (seconds) it lands in
        R until then. With ``connection``, an asyncpg connection inside a
        transaction, the message exists exactly when that transaction commits.
        A ``unique_id`` already stored in that queue is not stored again.
        ``reply_to`` names the endpoint the receiver's ``ctx.reply`` answers
        to (default: this one). ``priority`` (-100..100, higher first),
        ``sequence`` (members of one key are handled one at a time, in send
        order) and ``ttl`` seconds or ``expires_at`` (never handled after it)
        are described in docs/delivery.md. Returns the message's unique id.
        """
        if reply_to is not None:
            validate_queue_name(reply_to)
            headers = {**(headers or {}), REPLY_TO_HEADER: reply_to}
        envelope = self.envelopes.for_send(
            message,
            to,
            correlation_id,
            headers,
            unique_id,
            deliver_at,
            delay,
            delivery(priority, sequence, ttl, expires_at),
        )
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
        correlation_id = uuid.uuid4().hex
        reply_by = datetime.now(UTC) + timedelta(seconds=timeout)
        marks = {
            REPLY_TO_HEADER: self.endpoint,
            REQUESTER_HEADER: self.client_id,
            REPLY_BY_HEADER: reply_by.isoformat(),
        }
        future = self.replies.expect(correlation_id)
        try:
            await self.send(
                message, to, headers={**(headers or {}), **marks}, correlation_id=correlation_id
            )
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
        self,
        message: Message,
        *,
        headers: Mapping[str, str] | None = None,
        correlation_id: str | None = None,
        unique_id: str | None = None,
        deliver_at: datetime | None = None,
        delay: float | None = None,
        connection: Any = None,
        priority: int = 0,
        sequence: str | None = None,
        ttl: float | None = None,
        expires_at: datetime | None = None,
    ) -> list[str]:
        """Store a copy of ``message`` in the queue of every live subscriber, all or none.

        One round trip whatever the number of subscribers. Every copy carries
        the same correlation id (``correlation_id``, else the publish id) and
        its own unique_id, ``<publish id>/<subscriber>``; the publish id is
        ``unique_id`` when given, so publishing the same id again stores nothing
        new. With ``connection`` (asyncpg, in a transaction) the copies exist
        exactly when that transaction commits. ``priority``, ``sequence``, ``ttl``
        and ``expires_at`` apply to every copy; a sequence keeps its order in each
        subscriber's queue. Returns the subscriber endpoints.
        """
        envelope, chain = self.envelopes.for_publish(
            message,
            correlation_id,
            headers,
            unique_id,
            deliver_time(deliver_at, delay),
            delivery(priority, sequence, ttl, expires_at),
        )
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
        build = self.envelopes.for_publish
        pairs = [build(m, correlation_id, headers, None, None) for m in messages]
        envelopes = [envelope for envelope, _ in pairs]
        copies = await self.store.publish(
            self.endpoint, envelopes, [chain for _, chain in pairs], connection
        )
        self._log_published(len(envelopes), copies)
        return copies

    def _log_published(self, count: int, copies: Mapping[str, int]) -> None:
        if not copies:
            log.info("published_without_subscribers", queue=self.endpoint, messages=count)
        else:
            log.debug("published", queue=self.endpoint, messages=count, copies=dict(copies))
