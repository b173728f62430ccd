"""The connections of a process: what each is for, by name, and those its stores share.

A process that runs endpoints holds (docs/deployment.md, "Connection budget"):

========================  ==========================================================
``nmbus:send``            the send pool, up to ``send_pool_size``: sends and publishes
                          outside a handler, schema work at start, subscriptions,
                          retention, the ready floors and their analyzes, flow limits
``nmbus:<endpoint>:loop``  one per worker loop, kept while it runs (its batches, and
                          ``ctx.connection``)
``nmbus:listen``          one LISTEN for wake-ups, while a worker loop runs
``nmbus:<endpoint>:lease`` one for lease renewal and give-backs, opened at the first
``nmbus:forward``         with routes, the forwarder's: one to the outbox's database
                          and one to each remote database; ``nmbus:forward-listen``
                          its LISTEN
========================  ==========================================================

Each tells what it is for as its ``application_name`` (sent when it connects:
no round trip), so that ``pg_stat_activity`` shows it. A DSN that sets its own
``application_name`` keeps it, on every connection.

The endpoints of one process on one database (several Bus objects with one
DSN) share the send pool (:func:`open_pool`, one per DSN, size and
:class:`~nmbus.postgres.pooler.Pooler`) and the listener (:func:`listen_shared`,
one per DSN and channel). Each shared one
has one owner: a registry per event loop (asyncpg connections belong to the
loop that opened them; tests run each in a new one). The first store that
asks opens it; the last that lets go closes it, in whatever order they start
and stop.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

import asyncpg

from nmbus.postgres.listen import listen_loop
from nmbus.postgres.pooler import Pooler

#: What a connection is for: the last part of its application_name.
Use = Literal["send", "listen", "loop", "lease", "forward", "forward-listen"]


def server_settings(
    dsn: str | None, use: Use, endpoint: str | None = None, **settings: str
) -> dict[str, str]:
    """``settings``, with the application_name of a connection for ``use``.

    ``nmbus:<use>``, or ``nmbus:<endpoint>:<use>`` for an endpoint's own; none
    when ``dsn`` sets its own application_name (a query parameter, or in
    ``options``), which asyncpg then sends for every connection.
    """
    if not _names_itself(dsn):
        settings["application_name"] = ":".join(["nmbus", *([endpoint] if endpoint else []), use])
    return settings


def _names_itself(dsn: str | None) -> bool:
    if not dsn:
        return False
    try:
        query = parse_qs(urlsplit(dsn).query)
    except ValueError:
        return False  # asyncpg refuses it with its own error
    return "application_name" in query or any(
        "application_name" in value for value in query.get("options", [])
    )


# -- the send pool ----------------------------------------------------------------------


class SharedPool:
    """One send pool of a process, on one DSN, of one size, one pooler's; :func:`open_pool`'s."""

    __slots__ = ("_lock", "_owner", "key", "pool", "users")

    def __init__(self, key: tuple[str | None, int, Pooler], owner: dict[Any, SharedPool]) -> None:
        self.key = key
        self._owner = owner
        self.pool: asyncpg.Pool | None = None
        # The stores that opened it and have not closed it yet.
        self.users = 0
        self._lock = asyncio.Lock()

    async def open(self) -> asyncpg.Pool:
        """The pool, opened now unless it is open (a user counts itself first)."""
        async with self._lock:
            if self.pool is None:
                dsn, size, pooler = self.key
                self.pool = await asyncpg.create_pool(
                    dsn,
                    min_size=1,
                    max_size=size,
                    timeout=10,
                    server_settings=server_settings(dsn, "send"),
                    **pooler.pool_options(),
                )
            return self.pool

    async def close(self) -> None:
        """This user lets go; the last one closes the pool."""
        self.users -= 1
        if self.users > 0:
            return
        # Gone from the registry at once: a store that opens meanwhile gets a new pool.
        if self._owner.get(self.key) is self:
            del self._owner[self.key]
        if self.pool is not None:
            pool, self.pool = self.pool, None
            await asyncio.shield(pool.close())


_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Any, SharedPool]] = (
    weakref.WeakKeyDictionary()
)


async def open_pool(dsn: str | None, size: int, pooler: Pooler) -> SharedPool:
    """The process's send pool on ``dsn`` of ``size`` connections, opened by its first user
    with ``pooler``'s options.

    Each call is one user until its :meth:`SharedPool.close`. A user whose
    open fails (or is cancelled) is no user: the next one tries again.
    """
    registry = _pools.setdefault(asyncio.get_running_loop(), {})
    key = (dsn, size, pooler)
    shared = registry.get(key)
    if shared is None:
        shared = registry[key] = SharedPool(key, registry)
    # Counted before the wait: a user that lets go meanwhile never closes it under us.
    shared.users += 1
    try:
        await shared.open()
    except BaseException:
        await shared.close()
        raise
    return shared


# -- the listener -----------------------------------------------------------------------


class _SharedListener:
    """One LISTEN loop of a process, and the wake-up of each store that listens through it."""

    __slots__ = ("task", "wakeups")

    def __init__(self) -> None:
        self.wakeups: list[Callable[[str], None]] = []
        self.task: asyncio.Task[None] | None = None

    def notify(self, payload: str) -> None:
        for on_wakeup in list(self.wakeups):
            on_wakeup(payload)


_listeners: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[tuple[str | None, str], _SharedListener]
] = weakref.WeakKeyDictionary()


async def listen_shared(
    dsn: str | None,
    channel: str,
    on_wakeup: Callable[[str], None],
    connect: Callable[[], Awaitable[asyncpg.Connection]],
    reconnect_max: float,
    logger: Any,
) -> None:
    """Call ``on_wakeup(payload)`` for every NOTIFY on ``channel``, until cancelled.

    Through the process's one :func:`~nmbus.postgres.listen.listen_loop` on
    ``dsn`` and ``channel``: its first caller starts it (with ``connect``,
    ``reconnect_max`` and ``logger``), its last one stops it. A caller that
    joins a running one is told ``"*"`` at once, as the loop tells everyone
    each time it connects. Should the loop end, every caller's call raises
    what ended it; the next call starts it again.
    """
    registry = _listeners.setdefault(asyncio.get_running_loop(), {})
    key = (dsn, channel)
    shared = registry.get(key)
    if shared is None:
        shared = registry[key] = _SharedListener()
    shared.wakeups.append(on_wakeup)
    try:
        if shared.task is None or shared.task.done():
            shared.task = asyncio.create_task(
                listen_loop(connect, channel, shared.notify, reconnect_max, logger),
                name=f"nmbus-listener-{channel}",
            )
        else:
            on_wakeup("*")
        await asyncio.shield(shared.task)
    finally:
        shared.wakeups.remove(on_wakeup)
        if not shared.wakeups:
            if registry.get(key) is shared:
                del registry[key]
            if shared.task is not None:
                shared.task.cancel()
                await asyncio.gather(shared.task, return_exceptions=True)
