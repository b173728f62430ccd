"""Connections through a transaction pooler (PgBouncer's ``pool_mode = transaction``).

Such a pooler lends a server connection for one transaction at a time (an
autocommitted statement is one): nothing a session keeps outlives it. So with
``pooler="transaction"`` (``NMBUS_POOLER``) every connection nmbus opens

* prepares no named statement (asyncpg's ``statement_cache_size=0``: each
  statement is parsed, planned and run again, with the unnamed statement, in
  one transaction's round trips);
* applies no session setting (the worker's ``plan_cache_mode``: with nothing
  prepared there is no plan to keep, so there is nothing to force either;
  the operations' ``jit``, which stays as the server has it);
* runs no reset query when a pooled connection goes back (``RESET ALL`` and
  ``UNLISTEN *`` would reach whichever server connection the pooler picks);
* relies on no session state: LISTEN connects to ``listen_dsn``, a DSN that
  bypasses the pooler, or is not used (worker loops and the forwarder then
  look every ``poll_interval``); retention holds its one-run lock in a
  transaction of its own instead of a session lock (nmbus/postgres/retention.py).

Settings of a session are never startup parameters, which PgBouncer refuses in
every pool mode, but a ``SET`` once connected: so behind a session pooler
nmbus works with ``pooler="none"``.

Without the setting, a DSN that reaches a transaction pooler is refused at
start: :func:`refuse_deaf_listener` asks the server to deliver a NOTIFY to a
listening connection, which a server always does at once and a transaction
pooler never does (the idle listening client is attached to no server
connection). With it, a ``listen_dsn`` that does not hear what is sent through
the DSN (the pooler again, or another database) is refused the same way.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

import asyncpg

from nmbus.errors import InvalidSetting
from nmbus.postgres.errors import SET_POOLER, wrap_connect_errors
from nmbus.postgres.listen import close_quietly

PoolerMode = Literal["none", "transaction"]

#: Seconds the start waits for its own NOTIFY, before and after a round trip that
#: makes a server send whatever is pending (a server delivers it in milliseconds).
PROBE_WAIT = 1.0


async def _keep(_conn: asyncpg.Connection) -> None:
    """A pooled connection's reset behind a transaction pooler: none (asyncpg has
    already rolled back what was left open; anything else would reach whichever
    server connection the pooler lends)."""


@dataclass(frozen=True)
class Pooler:
    """How nmbus connects: straight to PostgreSQL, or through a transaction pooler."""

    mode: PoolerMode = "none"
    #: Where LISTEN connects behind a pooler (None: no LISTEN, wake-ups by polling).
    listen_dsn: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("none", "transaction"):
            raise InvalidSetting(f"pooler must be 'none' or 'transaction', got {self.mode!r}")

    @property
    def transaction(self) -> bool:
        return self.mode == "transaction"

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments of ``asyncpg.connect`` for a connection through the DSN."""
        return {"statement_cache_size": 0} if self.transaction else {}

    def pool_options(self, settings: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Keyword arguments of ``asyncpg.create_pool``: each new connection gets ``settings``."""
        if self.transaction:
            return {"statement_cache_size": 0, "reset": _keep}
        if not settings:
            return {}

        async def init(conn: asyncpg.Connection) -> None:
            await self.configure(conn, settings)

        return {"init": init}

    async def configure(self, conn: asyncpg.Connection, settings: Mapping[str, str]) -> None:
        """Give the session of ``conn`` its ``settings``; behind a transaction pooler none
        (a session setting would reach whichever server connection it lends)."""
        if settings and not self.transaction:
            names, values = zip(*settings.items(), strict=True)
            await conn.execute(
                "SELECT set_config(name, value, false) FROM unnest($1::text[], $2::text[]) "
                "AS s(name, value)",
                list(names),
                list(values),
            )

    @property
    def listens(self) -> bool:
        """Whether wake-ups come from LISTEN: straight to PostgreSQL, or with listen_dsn."""
        return not self.transaction or self.listen_dsn is not None

    def listen_on(self, dsn: str | None) -> str | None:
        """The DSN LISTEN connects to (when it :attr:`listens`)."""
        return self.listen_dsn if self.transaction else dsn

    @asynccontextmanager
    async def lock_holder(self, dsn: str | None) -> AsyncIterator[asyncpg.Connection | None]:
        """Behind a transaction pooler, a connection of its own whose open transaction
        holds a lock for a run that commits as it goes (retention's); else None, and
        the run holds a session lock on its own connection."""
        if not self.transaction:
            yield None
            return
        conn = await asyncpg.connect(dsn, timeout=10, **self.connect_options())
        try:
            yield conn
        finally:
            await close_quietly(conn)


#: Why a ``listen_dsn`` that gets no NOTIFY sent through the DSN is refused.
DEAF_LISTEN_DSN = (
    "listen_dsn (NMBUS_LISTEN_DSN) receives no notification sent through the DSN: it must "
    "reach the same database straight, not through the pooler"
)


async def notifies_arrive(
    connect: Callable[[], Awaitable[asyncpg.Connection]], notifier: Any
) -> bool:
    """Whether a connection of ``connect`` gets a NOTIFY that ``notifier`` sends.

    The connection LISTENs on a channel of its own and ``notifier`` (another
    connection) NOTIFYs it. PostgreSQL delivers it to the idle listener at once,
    and at the latest with the reply to the listener's next statement; a
    transaction pooler never does, since the listener, idle, is attached to no
    server connection (nor does a database other than the notifier's).
    """
    channel = f"nmbus_probe_{uuid.uuid4().hex}"  # letters and digits: no quoting needed
    arrived = asyncio.Event()
    listener = await connect()
    try:
        await listener.add_listener(channel, lambda *_args: arrived.set())
        await notifier.execute(f"NOTIFY {channel}")
        if await _arrives(arrived):
            return True
        await listener.execute("SELECT 1")  # the simple protocol: nothing prepared
        return await _arrives(arrived)
    finally:
        await close_quietly(listener)


async def refuse_deaf_listener(pooler: Pooler, dsn: str | None, notifier: Any) -> None:
    """Raise InvalidSetting when nmbus would not hear its NOTIFYs: without the pooler
    setting, ``dsn`` reaches a transaction pooler (:data:`SET_POOLER`); with it,
    ``listen_dsn`` does not reach the database straight (:data:`DEAF_LISTEN_DSN`).
    Nothing is asked behind a pooler without ``listen_dsn`` (nothing listens)."""
    if not pooler.listens:
        return
    target = pooler.listen_on(dsn)

    async def connect() -> asyncpg.Connection:
        with wrap_connect_errors(target):  # names the DSN (without its password)
            conn: asyncpg.Connection = await asyncpg.connect(target, timeout=10)
            return conn

    if not await notifies_arrive(connect, notifier):
        raise InvalidSetting(DEAF_LISTEN_DSN if pooler.transaction else SET_POOLER)


async def _arrives(arrived: asyncio.Event) -> bool:
    try:
        await asyncio.wait_for(arrived.wait(), timeout=PROBE_WAIT)
    except TimeoutError:
        return False
    return True
