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

from nmbus.errors import ConfigurationError, StoreError
from nmbus.messages import Message, type_name
from nmbus.store import validate_queue_name

if TYPE_CHECKING:
    from nmbus.settings import Settings
    from nmbus.store import Store

log = structlog.get_logger("nmbus.subscriptions")


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

    def publishers(self) -> set[str]:
        """Every publisher a declared (or to be removed) subscription names."""
        return {p for p, _ in self._declared} | {p for p, _ in self._removed}

    def _store(self, publisher: str) -> Store:
        return self.remote.get(publisher, self.store)

    async def _write(self, publisher: str, names: list[str], ttl: float | None) -> None:
        await self._store(publisher).subscribe(
            publisher, self.endpoint, names, ttl, remote=publisher in self.remote
        )

    def __len__(self) -> int:
        return len(self._declared)

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
        await self._store(publisher).unsubscribe(publisher, self.endpoint, [key[1]])
        log.info("unsubscribed", queue=self.endpoint, publisher=publisher, message_type=key[1])

    async def start(self) -> None:
        """Apply unsubscriptions made before start, then write every declared row."""
        self._started = True
        for publisher, name in sorted(self._removed):
            await self._store(publisher).unsubscribe(publisher, self.endpoint, [name])
        self._removed.clear()
        await self.renew(include_permanent=True)
        for sub in self._declared.values():
            log.info(
                "subscribed",
                queue=self.endpoint,
                publisher=sub.publisher,
                message_type=sub.type_name,
                ttl=None if sub.permanent else self.ttl,
            )

    @property
    def renewing(self) -> bool:
        """Whether any declared subscription expires (and so needs renewing)."""
        return self.ttl is not None and any(not s.permanent for s in self._declared.values())

    async def renew(self, include_permanent: bool = False) -> None:
        """Upsert the rows: one statement per (publisher, lifetime)."""
        groups: dict[tuple[str, float | None], list[str]] = {}
        for sub in self._declared.values():
            ttl = None if sub.permanent else self.ttl
            if ttl is None and not include_permanent:
                continue
            groups.setdefault((sub.publisher, ttl), []).append(sub.type_name)
        for (publisher, ttl), names in sorted(groups.items(), key=lambda g: g[0][0]):
            await self._write(publisher, sorted(names), ttl)

    async def run_renewer(self) -> None:
        """Renew every ttl/3 until cancelled; after a failure, retry sooner."""
        assert self.ttl is not None
        interval = self.ttl / 3
        delay = interval
        while True:
            await asyncio.sleep(delay)
            try:
                await self.renew()
                for store in {id(s): s for s in [self.store, *self.remote.values()]}.values():
                    await store.purge_expired_subscriptions(self.ttl)
            except StoreError as exc:
                delay = min(interval, 1.0)
                log.warning(
                    "subscription_renewal_failed",
                    queue=self.endpoint,
                    error=str(exc),
                    retry_in=round(delay, 3),
                )
                continue
            delay = interval
            log.debug("subscriptions_renewed", queue=self.endpoint, ttl=self.ttl)
