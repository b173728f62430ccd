"""A worker process that stops gracefully on SIGTERM (bus.stop()), for the shutdown test.

python -m tests.reliability.sigterm_worker DSN LOGFILE HANDLER_SECONDS SHUTDOWN_TIMEOUT

Each handler appends ``start N`` and ``end N`` to LOGFILE (unbuffered), writes
its effect through ctx.connection, and sleeps HANDLER_SECONDS in between.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import structlog

from nmbus import Bus, Context
from tests.messages import Ping


async def main(dsn: str, logfile: str, seconds: float, shutdown_timeout: float) -> None:
    fd = os.open(logfile, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    bus = Bus(
        "billing",
        dsn=dsn,
        concurrency=2,
        batch_size=10,
        lease_seconds=30,
        poll_interval=0.5,
        shutdown_timeout=shutdown_timeout,
    )

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        os.write(fd, f"start {msg.n}\n".encode())
        await ctx.connection.execute("INSERT INTO effects (n) VALUES ($1)", msg.n)
        await asyncio.sleep(seconds)
        os.write(fd, f"end {msg.n}\n".encode())

    stopping: list[asyncio.Task[None]] = []
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(
        signal.SIGTERM, lambda: stopping.append(asyncio.ensure_future(bus.stop()))
    )
    async with bus:
        print("ready", flush=True)
        await bus.wait_stopped()
    print("stopped", flush=True)


if __name__ == "__main__":
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])))
