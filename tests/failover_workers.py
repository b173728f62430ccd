"""The worker process of tests/reliability/test_failover.py, started twice by it.

python -m tests.failover_workers DSN QUEUE AUDIT_DSN OUTSIDE LOG

handles Pings until killed: each writes its effect through ``ctx.connection``
(``effects``: n, pid, when), appends ``n`` to the file OUTSIDE (an effect
outside the database, done again whenever a handler runs again), and sends a
copy to the queue ``audit`` of another database (AUDIT_DSN, a route: through
the outbox and the forwarder). A Ping numbered SLOW or more first sleeps past
its lease, so only a lease renewer that works keeps it from a second run. The
Bus runs its lease renewer, its listener, retention (every half second) and
the forwarder. Its log goes to the file LOG, one JSON object a line, with
``t`` (epoch seconds): the test reads what reconnected, and when.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

import structlog

from nmbus import Bus, Context
from tests.messages import Ping

LEASE = 2.0
RECONNECT_MAX = 1.0
#: Pings numbered from here sleep past their lease before they write.
SLOW = 1_000_000
#: Debug events kept in the log (the listener says it connected only at debug).
KEPT_DEBUG = {"listener_connected"}


def _log_to(path: str) -> None:
    out = open(path, "a", buffering=1)  # noqa: SIM115 (open for the life of the process)

    def keep(_logger: Any, level: str, event: dict[str, Any]) -> dict[str, Any]:
        if level == "debug" and event.get("event") not in KEPT_DEBUG:
            raise structlog.DropEvent
        return {**event, "level": level, "t": time.time(), "pid": os.getpid()}

    def write(_logger: Any, _level: str, event: dict[str, Any]) -> str:
        return json.dumps(event, default=str)

    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, keep, write],
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=True,
    )


def _append(path: str, n: int) -> None:
    """The outside effect: one line, appended (O_APPEND: whole lines from both processes)."""
    with open(path, "a") as done:
        done.write(f"{n}\n")


async def worker(dsn: str, queue: str, audit_dsn: str, outside: str) -> None:
    bus = Bus(
        queue,
        dsn=dsn,
        routes={"audit": audit_dsn},
        lease_seconds=LEASE,
        poll_interval=0.5,
        reconnect_max_delay=RECONNECT_MAX,
        retention_interval=0.5,
        max_attempts=20,
    )
    pid = os.getpid()

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        if msg.n >= SLOW:
            await asyncio.sleep(1.6 * LEASE)
        await ctx.connection.execute("INSERT INTO effects (n, pid) VALUES ($1, $2)", msg.n, pid)
        await ctx.send(Ping(n=msg.n), to="audit", unique_id=f"audit-{msg.n}")
        _append(outside, msg.n)

    async with bus:
        print("ready", flush=True)
        await bus.wait_stopped()


if __name__ == "__main__":
    dsn, queue, audit_dsn, outside, log = sys.argv[1:6]
    _log_to(log)
    asyncio.run(worker(dsn, queue, audit_dsn, outside))
