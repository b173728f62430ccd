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
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import structlog

from nmbus.dispatch import Dispatcher
from nmbus.envelopes import (
    REPLY_BY_HEADER,
    REPLY_TO_HEADER,
    REQUESTER_HEADER,
    EnvelopeBuilder,
    check_connection,
    deliver_time,
    delivery,
    type_name,
    user_headers,
)
from nmbus.errors import MAX_SECONDS, ConfigurationError
from nmbus.handlers import HandlerFunc, Registry
from nmbus.logs import log_failure
from nmbus.messages import Message
from nmbus.names import validate_queue_name
from nmbus.periodic import Schedule, Scheduler, Tick, TickHandler, router
from nmbus.replies import Replies
from nmbus.retry import RetryPolicy
from nmbus.sagas import S, Saga
from nmbus.settings import Settings, build_settings
from nmbus.store import Store
from nmbus.subscriptions import Subscriptions
from nmbus.supervise import Services
from nmbus.tracer import load as load_tracing
from nmbus.tracer import tracer_of
from nmbus.worker import Worker

if TYPE_CHECKING:
    from nmbus.metrics import WorkerMetrics

log = structlog.get_logger("nmbus.bus")

F = TypeVar("F", bound=HandlerFunc)


class Bus:
    """An endpoint of the bus: its name is its queue table.

    ``async with bus:`` creates the tables, registers subscriptions and starts
    ``settings.concurrency`` worker loops (0 for a send-only process).

    Arguments:

    * ``endpoint``: this endpoint's name, which is also its queue table's
      (``nmbus.<endpoint>``): 1-48 letters, digits, ``_``, ``.`` or ``-``.
    * ``dsn``: the PostgreSQL DSN (``postgresql://user:password@host/db``);
      default: ``NMBUS_DSN``.
    * ``settings``: a :class:`~nmbus.Settings` built beforehand; without it
      the settings come from ``NMBUS_*`` variables (docs/settings.md).
    * ``store``: a storage adapter in place of PostgreSQL, such as
      :class:`nmbus.testing.MemoryStore` in tests.
    * ``retry``: the default retry policy of this endpoint's handlers, a
      :class:`~nmbus.RetryPolicy` or a number of attempts (default: from
      ``max_attempts``, ``retry_delay`` and ``retry_max_delay``).
    * ``dead_letter``: the failure port, a queue that gets a copy of every
      message that lands in F (docs/delivery.md).
    * ``routes``: queue name -> DSN, or ``NMBUS_DB_<ALIAS>`` alias, of
      queues that live in other databases (docs/routes.md).
    * ``tracer_provider``: an OpenTelemetry tracer provider for this bus's
      spans (needs ``nmbus[otel]``; default: the global one).
    * ``**overrides``: any setting by its name (``concurrency=4``,
      ``batch_size=50``, ``poll_interval=1.0`` ...), over the ``NMBUS_*``
      variables or ``settings``; a bad value raises ``InvalidSetting``.
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
        routes: Mapping[str, str] | None = None,
        tracer_provider: Any = None,
        **overrides: Any,
    ) -> None:
        self.endpoint = validate_queue_name(endpoint)
        if routes is not None:
            # A queue -> DSN (or NMBUS_DB_<ALIAS> alias) mapping; validated with the settings.
            overrides = {**overrides, "routes": dict(routes)}
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
        # Queues that live in other databases, with their DSN (docs/routes.md).
        self.routes = settings.route_dsns()
        if self.endpoint in self.routes:
            raise ConfigurationError(
                f"endpoint {self.endpoint!r} cannot be routed to another database: "
                "its queue is in its own database (remove it from routes)"
            )
        if settings.dsn and (own := sorted(q for q, d in self.routes.items() if d == settings.dsn)):
            raise _routed_to_itself(self.endpoint, own)
        if store is None:
            if not settings.dsn:
                raise ConfigurationError(
                    "no database: pass Bus(..., dsn='postgresql://...') or set NMBUS_DSN"
                )
            from nmbus.postgres import PostgresStore

            store = PostgresStore(
                settings.dsn,
                settings.schema_name,
                settings.send_pool_size,
                routed=self.routes.keys(),
                create_queues=settings.create_queues,
            )
        elif self.routes:
            raise ConfigurationError(
                "routes need the PostgreSQL store the Bus builds itself: "
                "pass dsn=... instead of store=..."
            )
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
        # Both optional, both None unless wanted: docs/metrics.md, docs/tracing.md.
        self.metrics = _metrics(self.endpoint, settings)
        self.tracing = load_tracing(tracer_provider)
        self.worker = Worker(
            queue=self.endpoint,
            store=store,
            dispatcher=Dispatcher(
                self.endpoint,
                self.registry,
                self.retry,
                settings,
                self.envelopes,
                self.replies,
                metrics=self.metrics,
                tracing=self.tracing,
            ),
            settings=settings,
            client_id=self.client_id,
            dead_letter=self.dead_letter,
            metrics=self.metrics,
        )
        self.sagas: dict[str, Saga[Any]] = {}
        self._schedules: dict[str, Schedule] = {}
        self._background = Services(
            log, settings.reconnect_max_delay, f"nmbus-{self.endpoint}", queue=self.endpoint
        )
        self._remote_stores: list[Store] = []
        self.forwarder: Any = None  # nmbus.postgres.forwarder.Forwarder, when routes are set
        self._started = False
        self._stopped = asyncio.Event()

    def __repr__(self) -> str:
        return f"<Bus {self.endpoint!r} store={self.store!r}>"

    @property
    def metrics_port(self) -> int | None:
        """The port this bus serves ``/metrics`` on while it runs (the one picked for 0)."""
        return self.metrics.port if self.metrics is not None else None

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
        outside_effects: bool = True,
    ) -> Callable[[F], F]: ...

    def handler(
        self,
        target: Any = None,
        /,
        *,
        retry: RetryPolicy | int | None = None,
        timeout: float | None = None,
        outside_effects: bool = True,
    ) -> Any:
        """Register an async handler; the message type comes from its annotation.

        ``@bus.handler``, ``@bus.handler(retry=3, timeout=10)`` or
        ``@bus.handler(SomeMessage)`` all work.

        ``outside_effects=False`` declares that the handler's only effects go
        through ``ctx.connection``, ``ctx.send``, ``ctx.publish`` and
        ``ctx.reply`` (no HTTP call, no file, no other database): a batch of
        such messages then runs without a savepoint per message, and when one
        of them fails after writing, the batch is rolled back and run again
        with savepoints. The replayed handlers run twice, but nothing of their
        first run was ever visible (docs/handlers.md).
        """
        if target is not None and not isinstance(target, type):
            self.registry.add(target, None, retry, timeout, outside_effects)
            return target
        message_type = target

        def register(func: F) -> F:
            self.registry.add(func, message_type, retry, timeout, outside_effects)
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
        if self.metrics is not None:
            self.metrics.start()
        try:
            await self.store.open()
        except BaseException:
            await self._stop_metrics()
            raise
        try:
            if self.routes:
                await self._refuse_routes_to_itself()
            await self.store.ensure_queue(self.endpoint)
            if self.sagas:
                await self.store.ensure_sagas(self.endpoint)
            await self._open_remote_publishers()
            await self.subscriptions.start()
        except BaseException:
            await self._close_remote_stores()
            await self.store.close()
            await self._stop_metrics()
            raise
        if self.subscriptions.renewing:
            self._spawn(self.subscriptions.run_renewer, "subscriptions")
        if self.settings.concurrency > 0:
            # No handlers is no warning: a requester's workers receive its replies
            # (bus.request), and bus_started says handlers=0.
            if self.routes:
                from nmbus.postgres.forwarder import Forwarder

                assert self.settings.dsn is not None
                self.forwarder = Forwarder(
                    self.settings.dsn,
                    self.routes,
                    schema=self.settings.schema_name,
                    batch_size=self.settings.forward_batch_size,
                    poll_interval=self.settings.poll_interval,
                    reconnect_max=self.settings.reconnect_max_delay,
                )
                self._spawn(self.forwarder.run, "forwarder")
            interval = self.settings.retention_interval
            if interval is not None:
                self._spawn(lambda: self._retention(interval), "retention")
            if self._schedules:
                scheduler = Scheduler(
                    self.endpoint, self.store, self.envelopes, list(self._schedules.values())
                )
                self._spawn(scheduler.run, "periodic")
            self.worker.start()
        elif self.routes:
            # A send-only process: what it routes waits in the outbox for a forwarder.
            log.info("outbox_needs_a_forwarder", queue=self.endpoint, routes=sorted(self.routes))
        log.info(
            "bus_started",
            queue=self.endpoint,
            concurrency=self.settings.concurrency,
            handlers=len(self.registry),
            subscriptions=len(self.subscriptions),
            **({} if self.metrics is None else {"metrics_port": self.metrics.port}),
        )

    async def stop(self) -> None:
        """Graceful shutdown: finish in-flight handlers, return unstarted messages to I."""
        if not self._started or self._stopped.is_set():
            return
        try:
            await self.worker.stop()
        finally:
            await self._background.stop()
            await self._close_remote_stores()
            await self.store.close()
            await self._stop_metrics()
            self._stopped.set()
            log.info("bus_stopped", queue=self.endpoint, handled=self.worker.handled)

    async def _stop_metrics(self) -> None:
        if self.metrics is not None:
            # Its server's shutdown waits for the serving thread's next poll.
            await asyncio.to_thread(self.metrics.stop)

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

    async def _open_remote_publishers(self) -> None:
        """A store on the database of each routed publisher this endpoint subscribes to.

        The publisher's subscriptions table is the one its publish reads, so a
        subscriber in another database registers (and renews) its rows there.
        The stores are opened by the subscriptions when they first write: a
        publisher's database that is down does not keep this endpoint from
        starting (docs/routes.md).
        """
        from nmbus.postgres import PostgresStore

        by_dsn: dict[str, Store] = {}
        for publisher in sorted(self.subscriptions.publishers()):
            dsn = self.routes.get(publisher)
            if dsn is None:
                continue
            if dsn not in by_dsn:
                store = PostgresStore(dsn, self.settings.schema_name, 1)
                self._remote_stores.append(store)
                by_dsn[dsn] = store
            self.subscriptions.route(publisher, by_dsn[dsn])

    async def _refuse_routes_to_itself(self) -> None:
        """Refuse a route whose DSN reaches this endpoint's own database, however spelt.

        Its copies would go into the outbox for a forwarder to move to the very
        database they are in: a subscriber's rows marked remote in its own
        database stranded published copies there for ever (docs/routes.md).
        """
        from nmbus.postgres import PostgresStore

        assert isinstance(self.store, PostgresStore)
        own = await self.store.routes_to_itself(self.routes)
        if own:
            raise _routed_to_itself(self.endpoint, own)

    async def _close_remote_stores(self) -> None:
        stores, self._remote_stores = self._remote_stores, []
        for store in stores:
            await store.close()

    def _spawn(self, run: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        """Run a side task of the bus, supervised: logged and restarted whenever it dies."""
        self._background.start(name, run)

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
        A queue that no endpoint has created (its endpoint never started in this
        database: a typo?) is created, marked and logged once
        (``queue_created_by_send``); with ``create_queues=False``
        (NMBUS_CREATE_QUEUES=false) the send is refused with QueueNotFound
        instead (docs/operations.md).
        ``reply_to`` names the endpoint the receiver's ``ctx.reply`` answers
        to (default: this one). ``priority`` (-100..100, higher first),
        ``sequence`` (members of one key are handled one at a time, in send
        order) and ``ttl`` seconds or ``expires_at`` (never handled after it)
        are described in docs/delivery.md. Returns the message's unique id.

        Refused with InvalidMessage, before anything is written: headers that
        are not a mapping of str to str or that use nmbus's own names
        (``nmbus-*``), a ``unique_id`` or ``correlation_id`` that is not a str of
        at most 1,000 UTF-8 bytes, a ``connection`` that is not an asyncpg
        connection; MessageTooLarge when body and headers together exceed
        ``max_message_bytes``.
        """
        return await self._send(
            message,
            to,
            deliver_at=deliver_at,
            delay=delay,
            headers=user_headers(headers),
            unique_id=unique_id,
            correlation_id=correlation_id,
            connection=connection,
            reply_to=reply_to,
            priority=priority,
            sequence=sequence,
            ttl=ttl,
            expires_at=expires_at,
        )

    async def _send(
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
        """``send`` with nmbus's own headers allowed (``request`` sets them)."""
        check_connection(connection)
        if reply_to is not None:
            validate_queue_name(reply_to)
            headers = {**(headers or {}), REPLY_TO_HEADER: reply_to}
        controls = delivery(priority, sequence, ttl, expires_at)
        with tracer_of(self.tracing).producing("send", to) as producer:
            envelope = self.envelopes.for_send(
                message,
                to,
                correlation_id,
                producer.headers(headers),
                unique_id,
                deliver_at,
                delay,
                controls,
            )
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
            await self._send(
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
        subscriber's queue. Returns the subscriber endpoints. Refused as ``send``
        refuses (headers, ids, connection, size).
        """
        headers = user_headers(headers)
        check_connection(connection)
        when = deliver_time(deliver_at, delay)
        controls = delivery(priority, sequence, ttl, expires_at)
        build = self.envelopes.for_publish
        with tracer_of(self.tracing).producing("publish", type_name(message)) as producer:
            traced = producer.headers(headers)
            envelope, chain = build(message, correlation_id, traced, unique_id, when, controls)
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
        build = self.envelopes.for_publish
        pairs = [build(m, correlation_id, headers, None, None) for m in messages]
        envelopes = [envelope for envelope, _ in pairs]
        return await self.store.publish(
            self.endpoint, envelopes, [chain for _, chain in pairs], connection
        )

    def _log_published(self, count: int, copies: Mapping[str, int]) -> None:
        if not copies:
            log.info("published_without_subscribers", queue=self.endpoint, messages=count)
        else:
            log.debug("published", queue=self.endpoint, messages=count, copies=dict(copies))


def _routed_to_itself(endpoint: str, queues: list[str]) -> ConfigurationError:
    return ConfigurationError(
        f"routes of endpoint {endpoint!r}: {', '.join(map(repr, queues))} "
        "go to this endpoint's own database (the route's DSN reaches the database of "
        "its dsn): queues of one database need no route, remove it (their messages "
        "would wait in the outbox for ever)"
    )


def _metrics(endpoint: str, settings: Settings) -> WorkerMetrics | None:
    """The worker's metrics when ``metrics_port`` is set (prometheus_client is imported then)."""
    if settings.metrics_port is None:
        return None
    from nmbus.metrics import WorkerMetrics

    return WorkerMetrics(endpoint, settings.metrics_host, settings.metrics_port)
