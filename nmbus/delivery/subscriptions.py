"""Publish/subscribe: who receives what, kept alive while a subscriber runs.

A subscription is a row of ``{schema}.subscriptions`` (publisher_endpoint,
subscriber_endpoint, message_type, created_date, expiration_date): "copy every
``message_type`` that ``publisher_endpoint`` publishes into the queue table of
``subscriber_endpoint``". Where a subscription is, over time:

1. ``bus.subscribe(T, publisher="orders")`` declares it; nothing is written.
2. ``async with bus:`` writes (upserts) the rows, expiring ``subscription_ttl``
   seconds from now, or never for ``permanent=True`` / ``subscription_ttl=None``.
3. While the bus runs, a background task renews them every ``ttl / 3``, so a
   row is always at least two thirds of its lifetime away from expiry. A
   renewal also writes back a row someone deleted.
4. A subscriber that stops (or is killed) stops renewing. Publishers keep
   filling its queue until ``expiration_date`` passes, so a restart loses
   nothing; after that it receives nothing more. Expired rows are deleted one
   lifetime later by any running subscriber.
5. ``await bus.unsubscribe(T, publisher=...)`` deletes the rows at once.

A publisher in another database (a route of the subscriber's bus) keeps its
subscriptions table there: the subscriber writes, renews and removes its rows
in that database, marked ``subscriber_remote``, so the publisher sends the
copies through its outbox and never into a local table (docs/routes.md).

There is no subscriber cache on the publishing side: the lookup is part of the
one statement that stores the copies (``nmbus_publish_v3``, installed by the
PostgreSQL store), so a publish sees every subscription committed before that
statement began. A type-chain header lets a subscriber that only knows a base
class decode a subclass it has never heard of.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from nmbus.errors import ConfigurationError, DatabaseUnavailable, StoreError
from nmbus.messages import Message, type_name
from nmbus.names import validate_queue_name

if TYPE_CHECKING:
    from nmbus.ports.store import Store
    from nmbus.settings import Settings

log = structlog.get_logger("nmbus.subscriptions")

# Seconds between tries to write the rows a publisher's database still owes.
RETRY_PENDING = 1.0


@dataclass(frozen=True, slots=True)
class Subscription:
    publisher: str
    message_type: type[Message]
    permanent: bool

    @property
    def type_name(self) -> str:
        return type_name(self.message_type)


class Subscriptions:
    """The subscriptions one endpoint declares, written at start and renewed while it runs."""

    def __init__(self, endpoint: str, store: Store, settings: Settings) -> None:
        self.endpoint = endpoint
        self.store = store
        self.ttl = settings.subscription_ttl
        self._declared: dict[tuple[str, str], Subscription] = {}
        self._removed: set[tuple[str, str]] = set()
        self._started = False
        # Publishers living in other databases (routes), by name: their
        # subscriptions table is there, so this endpoint registers there.
        self.remote: dict[str, Store] = {}
        # Those remote stores opened so far, by id: a publisher's database may be
        # down when this endpoint starts, and is opened once it answers.
        self._opened: set[int] = set()
        # Remote publishers whose rows are not written yet: their database was down.
        self._pending: set[str] = set()

    def route(self, publisher: str, store: Store) -> None:
        """Keep the rows for ``publisher`` in ``store``: it lives in another database.

        Its publish reads the subscriptions table of its own database, so this
        endpoint writes, renews and removes its rows there (docs/routes.md).
        """
        self.remote[publisher] = store

    def publishers(self) -> set[str]:
        """Every publisher a declared (or to be removed) subscription names."""
        return {p for p, _ in self._declared} | {p for p, _ in self._removed}

    def _store(self, publisher: str) -> Store:
        return self.remote.get(publisher, self.store)

    async def _write(self, publisher: str, names: list[str], ttl: float | None) -> None:
        store = await self._open(publisher)
        await store.subscribe(publisher, self.endpoint, names, ttl, remote=publisher in self.remote)

    async def _open(self, publisher: str) -> Store:
        store = self._store(publisher)
        if publisher in self.remote and id(store) not in self._opened:
            await store.open()
            self._opened.add(id(store))
        return store

    @property
    def pending(self) -> set[str]:
        """Remote publishers whose database has not answered yet: rows still to write."""
        return set(self._pending)

    def __len__(self) -> int:
        return len(self._declared)

    @property
    def declared(self) -> list[Subscription]:
        """The subscriptions this endpoint holds (declared and not unsubscribed)."""
        return list(self._declared.values())

    def add(self, message_type: type[Message], publisher: str, permanent: bool) -> None:
        if not (isinstance(message_type, type) and issubclass(message_type, Message)):
            raise ConfigurationError(f"subscribe() needs a Message subclass, got {message_type!r}")
        if message_type is Message:
            raise ConfigurationError("subscribe to a Message subclass, not Message itself")
        validate_queue_name(publisher)
        if self._started:
            raise ConfigurationError(
                f"subscribe({type_name(message_type)}, publisher={publisher!r}) after the bus "
                "started: declare subscriptions before 'async with bus:'"
            )
        key = (publisher, type_name(message_type))
        self._removed.discard(key)
        self._declared[key] = Subscription(publisher, message_type, permanent)

    async def remove(self, message_type: type[Message], publisher: str) -> None:
        validate_queue_name(publisher)
        key = (publisher, type_name(message_type))
        self._declared.pop(key, None)
        if not self._started:
            # Applied at start, when the store is open.
            self._removed.add(key)
            return
        await (await self._open(publisher)).unsubscribe(publisher, self.endpoint, [key[1]])
        log.info("unsubscribed", queue=self.endpoint, publisher=publisher, message_type=key[1])

    async def start(self) -> None:
        """Apply unsubscriptions made before start, then write every declared row.

        A publisher in another database that does not answer does not stop the
        endpoint: its rows are written by ``run_renewer`` once it does.
        """
        self._started = True
        for publisher, name in sorted(self._removed):
            try:
                await (await self._open(publisher)).unsubscribe(publisher, self.endpoint, [name])
            except DatabaseUnavailable as exc:
                if publisher not in self.remote:
                    raise
                self._wait_for(publisher, exc)
                continue
            self._removed.discard((publisher, name))
        try:
            await self.renew(include_permanent=True)
        except DatabaseUnavailable:
            if not self._pending:
                raise
        for sub in self._declared.values():
            if sub.publisher not in self._pending:
                self._subscribed(sub)

    def _subscribed(self, sub: Subscription) -> None:
        log.info(
            "subscribed",
            queue=self.endpoint,
            publisher=sub.publisher,
            message_type=sub.type_name,
            ttl=None if sub.permanent else self.ttl,
        )

    def _wait_for(self, publisher: str, exc: StoreError) -> None:
        if publisher not in self._pending:
            log.warning(
                "subscription_pending",
                queue=self.endpoint,
                publisher=publisher,
                error=str(exc),
                retry_in=RETRY_PENDING,
            )
        self._pending.add(publisher)

    @property
    def renewing(self) -> bool:
        """Whether a renewer must run: a subscription expires, or one is still to write."""
        expiring = self.ttl is not None and any(not s.permanent for s in self._declared.values())
        return expiring or bool(self._pending)

    async def renew(self, include_permanent: bool = False) -> None:
        """Upsert the rows: one statement per (publisher, lifetime).

        A remote publisher's database that does not answer leaves its rows
        pending (every one of them, permanent ones too, is written once it
        does) and the others are still written; DatabaseUnavailable is raised
        at the end. A failure of this endpoint's own database is raised at once.
        """
        groups: dict[tuple[str, float | None], list[str]] = {}
        for sub in self._declared.values():
            ttl = None if sub.permanent else self.ttl
            if ttl is None and not include_permanent and sub.publisher not in self._pending:
                continue
            groups.setdefault((sub.publisher, ttl), []).append(sub.type_name)
        failed: DatabaseUnavailable | None = None
        down: set[str] = set()
        for (publisher, ttl), names in sorted(groups.items(), key=lambda g: g[0][0]):
            if publisher in down:
                continue
            try:
                await self._write(publisher, sorted(names), ttl)
            except DatabaseUnavailable as exc:
                if publisher not in self.remote:
                    raise
                self._wait_for(publisher, exc)
                down.add(publisher)
                failed = exc
        removing = {publisher for publisher, _ in self._removed}
        for publisher in sorted(self._pending - down - removing):
            self._pending.discard(publisher)  # every row it owed was written just now
            for sub in self._declared.values():
                if sub.publisher == publisher:
                    self._subscribed(sub)
        if failed is not None:
            raise failed

    async def _retry_removals(self) -> None:
        """Unsubscriptions made before start that a database that was down still owes."""
        for publisher, name in sorted(self._removed):
            try:
                await (await self._open(publisher)).unsubscribe(publisher, self.endpoint, [name])
            except DatabaseUnavailable as exc:
                self._wait_for(publisher, exc)
                continue
            self._removed.discard((publisher, name))

    def _open_stores(self) -> list[Store]:
        stores = [self.store, *(s for s in self.remote.values() if id(s) in self._opened)]
        return list({id(s): s for s in stores}.values())

    async def run_renewer(self) -> None:
        """Renew every ttl/3 until cancelled; after a failure, retry sooner.

        With nothing that expires, it only writes what a database that was down
        at start still owes, and returns once that is done.
        """
        expiring = self.ttl is not None and any(not s.permanent for s in self._declared.values())
        interval = self.ttl / 3 if expiring and self.ttl is not None else RETRY_PENDING
        delay = min(interval, RETRY_PENDING) if self._pending or self._removed else interval
        while True:
            await asyncio.sleep(delay)
            try:
                await self._retry_removals()
                await self.renew()
                if self.ttl is not None:
                    for store in self._open_stores():
                        await store.purge_expired_subscriptions(self.ttl)
            except StoreError as exc:
                delay = min(interval, RETRY_PENDING)
                if not isinstance(exc, DatabaseUnavailable) or not self._pending:
                    log.warning(
                        "subscription_renewal_failed",
                        queue=self.endpoint,
                        error=str(exc),
                        retry_in=round(delay, 3),
                    )
                continue
            if not expiring and not self._pending and not self._removed:
                return  # nothing left to write, and nothing expires
            delay = min(interval, RETRY_PENDING) if self._pending or self._removed else interval
            log.debug("subscriptions_renewed", queue=self.endpoint, ttl=self.ttl)
