"""What every sample service does at its edge: configure output, run until a signal."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import structlog

from nmbus import Bus


def configure_output() -> None:
    # Applications configure logging; nmbus only logs. Warnings show the retries.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        processors=[
            structlog.processors.add_log_level,
            structlog.dev.ConsoleRenderer(colors=False),
        ],
    )


async def run_until_signal(
    bus: Bus,
    stop: asyncio.Event | None = None,
    work: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run ``bus`` (and ``work``, once it started) until SIGINT/SIGTERM or ``stop``."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with bus:
        print(f"[{bus.endpoint}] ready", flush=True)
        task = asyncio.create_task(work()) if work is not None else None
        await stop.wait()
        if task is not None:
            task.cancel()
    print(f"[{bus.endpoint}] stopped", flush=True)
