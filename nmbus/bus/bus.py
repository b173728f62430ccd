"""The Bus: one endpoint, its queue table, its handlers, subscriptions and workers.

The Bus is the composition root: it builds the settings, the store, the
handler registry, the envelope builder and the Worker, wires them together,
and runs their life cycle. Sending goes Bus -> EnvelopeBuilder -> Store;
handling goes Worker -> Dispatcher -> handlers; nothing below calls back up.

Its methods come in three parts: what an endpoint declares (handlers, sagas,
periodic handlers, subscriptions: :mod:`nmbus.bus.registration`), what it sends
(send, publish, request: :mod:`nmbus.bus.sending`), and here how it is built, started
and stopped.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import uuid
from collections.abc import Callable, Coroutine, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

import structlog

from nmbus.bus.registration import OutgoingTypes, Registration
from nmbus.bus.sending import Sending
from nmbus.consume.dispatch import Dispatcher
from nmbus.consume.worker import Worker
from nmbus.delivery.periodic import Schedule, Scheduler
from nmbus.delivery.replies import Replies
from nmbus.delivery.subscriptions import Subscriptions
from nmbus.envelopes import EnvelopeBuilder
from nmbus.errors import (
    TOO_MANY_CONNECTIONS,
    ConfigurationError,
    DatabaseUnavailable,
    StoreError,
    cancelled_by_server,
    caused_by,
)
from nmbus.handlers import Registry
from nmbus.logs import log_failure
from nmbus.maintenance.supervise import Backoff, Services
from nmbus.names import validate_queue_name
from nmbus.ports.store import Store
from nmbus.retry import RetryPolicy
from nmbus.sagas.saga import Saga
from nmbus.settings import Settings, build_settings
from nmbus.telemetry.tracer import load as load_tracing

if TYPE_CHECKING:
    from nmbus.telemetry.health import Health
    from nmbus.telemetry.metrics import WorkerMetrics
    from nmbus.telemetry.server import PortServer

log = structlog.get_logger("nmbus.bus")

_FULL = frozenset({TOO_MANY_CONNECTIONS})


class Bus(Registration, Sending):
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
            from nmbus.postgres.claimcheck import ClaimCheck
            from nmbus.postgres.pooler import Pooler

            store = PostgresStore(
                settings.dsn,
                settings.schema_name,
                settings.send_pool_size,
                routed=self.routes.keys(),
                create_queues=settings.create_queues,
                pooler=Pooler(settings.pooler, settings.listen_dsn),
                endpoint=self.endpoint,
                claim_check=ClaimCheck(settings.claim_check_store),
            )
        elif self.routes:
            raise ConfigurationError(
                "routes need the PostgreSQL store the Bus builds itself: "
                "pass dsn=... instead of store=..."
            )
        self.store: Store = store
        self.registry = Registry()
        # Encrypted fields are sealed and opened by the codec (nmbus.contracts.encryption).
        self.registry.codec.keys = settings.encryption_keys
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
        self.envelopes = EnvelopeBuilder(
            settings.max_message_bytes,
            codec=self.registry.codec,
            claim_check_bytes=settings.claim_check_bytes,
        )
        self.envelopes.routed = frozenset(self.routes)
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
        self.outgoing_types = OutgoingTypes()
        self._schedules: dict[str, Schedule] = {}
        self._background = Services(
            log, settings.reconnect_max_delay, f"nmbus-{self.endpoint}", queue=self.endpoint
        )
        # The metrics port: /metrics, and the probes /healthz and /readyz (docs/operations.md).
        self.health: Health | None = None
        self._port: PortServer | None = None
        if self.metrics is not None:
            self.health, self._port = self._port_server(self.metrics)
        self._remote_stores: list[Store] = []
        self.forwarder: Any = None  # nmbus.postgres.forwarder.Forwarder, when routes are set
        self._started = False
        self._stopped = asyncio.Event()

    def __repr__(self) -> str:
        return f"<Bus {self.endpoint!r} store={self.store!r}>"

    @property
    def metrics_port(self) -> int | None:
        """The port this bus serves ``/metrics``, ``/healthz`` and ``/readyz`` on while it
        runs (the one picked for 0)."""
        return self._port.port if self._port is not None else None

    def _port_server(self, metrics: WorkerMetrics) -> tuple[Health, PortServer]:
        from nmbus.telemetry.health import Health
        from nmbus.telemetry.server import PortServer

        health = Health(
            self.endpoint,
            self.settings.schema_name,
            tasks=lambda: [*self.worker.tasks(), *self._background.named()],
            check=lambda: self.store.readiness(self.endpoint),
        )
        probes = {"/healthz": health.live, "/readyz": health.ready}
        port = self.settings.metrics_port or 0
        return health, PortServer(self.settings.metrics_host, port, metrics.app, probes)

    # -- life cycle ----------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            raise RuntimeError(f"bus {self.endpoint!r} is already started")
        self._started = True
        if self._port is not None and self.health is not None:
            self.health.start()
            try:
                self._port.start()
            except BaseException:
                self.health.stop()
                raise
        try:
            await self._open_store()
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
                from nmbus.postgres.pooler import Pooler

                assert self.settings.dsn is not None
                self.forwarder = Forwarder(
                    self.settings.dsn,
                    self.routes,
                    schema=self.settings.schema_name,
                    batch_size=self.settings.forward_batch_size,
                    poll_interval=self.settings.poll_interval,
                    reconnect_max=self.settings.reconnect_max_delay,
                    pooler=Pooler(self.settings.pooler, self.settings.listen_dsn),
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
            await self.worker.declare_limits()
        elif self.routes:
            # A send-only process: what it routes waits in the outbox for a forwarder.
            log.info("outbox_needs_a_forwarder", queue=self.endpoint, routes=sorted(self.routes))
        if self.health is not None:
            self.health.running()  # before it says so: a probe that follows sees it running
        log.info(
            "bus_started",
            queue=self.endpoint,
            concurrency=self.settings.concurrency,
            handlers=len(self.registry),
            subscriptions=len(self.subscriptions),
            **({} if self._port is None else {"metrics_port": self._port.port}),
        )

    async def _open_store(self) -> None:
        """Open the store; while the server refuses connections for a limit, try again.

        A server at ``max_connections`` (or a database's or role's ``CONNECTION
        LIMIT``) is shared with other services: the bus starts once a connection
        is free, one line per try (``too_many_connections``), the pauses doubling
        up to ``reconnect_max_delay``. Any other failure is raised at once.
        """
        backoff = Backoff(self.settings.reconnect_max_delay)
        while True:
            try:
                await self.store.open()
                return
            except DatabaseUnavailable as exc:
                await self.store.close()  # what it opened before the refusal
                if not caused_by(exc, _FULL):
                    raise
                pause = backoff.next()
                log.warning(
                    "too_many_connections",
                    queue=self.endpoint,
                    attempt=backoff.failures,
                    error=str(exc),
                    retry_in=round(pause, 3),
                )
                await asyncio.sleep(pause)

    async def stop(self) -> None:
        """Graceful shutdown: finish in-flight handlers, return unstarted messages to I."""
        if not self._started or self._stopped.is_set():
            return
        if self.health is not None:
            self.health.stopping()
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
        if self.health is not None:
            self.health.stop()
        if self._port is not None:
            # Its server's shutdown waits for the serving thread's next poll.
            await asyncio.to_thread(self._port.stop)

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
        from nmbus.postgres.pooler import Pooler

        by_dsn: dict[str, Store] = {}
        for publisher in sorted(self.subscriptions.publishers()):
            dsn = self.routes.get(publisher)
            if dsn is None:
                continue
            if dsn not in by_dsn:
                # Behind the same pooler as this endpoint's (it prepares nothing, LISTENs never).
                store = PostgresStore(
                    dsn, self.settings.schema_name, 1, pooler=Pooler(self.settings.pooler)
                )
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
            except (DatabaseUnavailable, StoreError) as exc:
                if not isinstance(exc, DatabaseUnavailable) and not cancelled_by_server(exc):
                    log_failure(log, "retention_failed", exc, "warning", queue=self.endpoint)
                else:
                    # The server's doing (down, full, or its statement_timeout): one line;
                    # a step that was cancelled was rolled back, the next run goes on.
                    log.warning("retention_failed", queue=self.endpoint, error=str(exc))
            except Exception as exc:
                log_failure(log, "retention_failed", exc, "warning", queue=self.endpoint)


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
    from nmbus.telemetry.metrics import WorkerMetrics

    return WorkerMetrics(endpoint)
