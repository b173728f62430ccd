"""The LISTEN loop: wake-ups by NOTIFY, kept through lost connections; the channel names.

A store's listener (workers woken when a row is inserted into their queue)
and the forwarder's (woken when a row is written into the outbox) are one
loop with different channels and log events. Each session connects, LISTENs,
calls ``on_notify("*")`` (whatever was announced while nobody listened must
be looked at now) and then waits, checking every few seconds with a cheap
round trip that the server is still there. A session that ends (the
connection lost or failed) is started again under
:func:`nmbus.maintenance.supervise.supervise`, after a pause that grows up to
``reconnect_max`` and starts over once connected.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from nmbus.logs import log_failure, scrub
from nmbus.maintenance.supervise import Backoff, supervise
from nmbus.postgres.errors import is_connection_error

#: Seconds between two checks that a quiet listening connection is still alive
#: (a round trip notices a dead server sooner than TCP does), and the longest
#: wait for one.
KEEPALIVE = 5.0


def notify_channel(schema: str, outbox: bool = False) -> str:
    """The LISTEN/NOTIFY channel of ``schema``: the one name every NOTIFY and LISTEN uses.

    Inserts into ``schema``'s queues are announced on ``nmbus_{schema}`` (the
    payload names the queue); with ``outbox=True``, rows written into its
    outbox for the forwarder, on ``nmbus_outbox_{schema}``.
    """
    return f"nmbus_outbox_{schema}" if outbox else f"nmbus_{schema}"


async def close_quietly(conn: asyncpg.Connection) -> None:
    """Close ``conn`` (at most 2 s, even when cancelled meanwhile); else drop it."""
    try:
        await asyncio.shield(asyncio.wait_for(conn.close(), timeout=2))
    except Exception:
        conn.terminate()


async def listen_loop(
    connect: Callable[[], Awaitable[asyncpg.Connection]],
    channel: str,
    on_notify: Callable[[str], None],
    reconnect_max: float,
    logger: Any,
    *,
    lost: str = "listener_connection_lost",
    failed: str | None = "listener_failed",
) -> None:
    """Call ``on_notify(payload)`` for every NOTIFY on ``channel``, until cancelled.

    A lost connection is logged as ``lost`` (a warning, with ``error=`` when
    an error told of it); any other failure as ``failed`` (an error with its
    traceback, passwords scrubbed), or as ``lost`` too when ``failed`` is None.
    """
    backoff = Backoff(reconnect_max)

    def callback(_conn: object, _pid: int, _channel: str, payload: object) -> None:
        on_notify(str(payload))

    async def session() -> None:
        conn = await connect()
        try:
            closed = asyncio.Event()
            conn.add_termination_listener(lambda _c: closed.set())
            await conn.add_listener(channel, callback)
            logger.debug("listener_connected", channel=channel)
            backoff.reset()
            on_notify("*")
            while not closed.is_set():
                try:
                    await asyncio.wait_for(closed.wait(), timeout=KEEPALIVE)
                except TimeoutError:
                    await conn.fetchval("SELECT 1", timeout=KEEPALIVE)
            logger.warning(lost, channel=channel)
        finally:
            await close_quietly(conn)

    def report(exc: BaseException, _pause: float) -> None:
        unexpected = not is_connection_error(exc) and not isinstance(exc.__cause__, BaseException)
        if failed is not None and unexpected:
            log_failure(logger, failed, exc, channel=channel)
        else:
            logger.warning(lost, channel=channel, error=scrub(str(exc)))

    await supervise(
        session, "listener", logger, reconnect_max, restart=True, backoff=backoff, report=report
    )
