"""``nmbus worker module:bus``: run a Bus until SIGTERM or SIGINT, then stop gracefully."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Annotated, Any

import structlog
import typer

from nmbus.bus import Bus
from nmbus.cli import app
from nmbus.cli._common import LogFormat, LogLevel, configure_logging, fail, options

log = structlog.get_logger("nmbus.cli.worker")


def load_bus(target: str) -> Any:
    """Import ``module:attribute``; the attribute is a Bus or a callable returning one."""
    # A target that names nothing is a bad argument (exit 2); a module that
    # fails while it is imported is the application's failure (exit 1).
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        fail(f"expected module:attribute (for example myapp.service:bus), got {target!r}", 2)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = isinstance(exc, ModuleNotFoundError) and exc.name is not None
        named = missing and (module_name == exc.name or module_name.startswith(f"{exc.name}."))
        fail(f"cannot import {module_name!r}: {exc}", 2 if named else 1)
    obj: Any = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            fail(f"{module_name!r} has no attribute {attribute!r}", 2)
        obj = getattr(obj, part)
    return obj


async def _resolve(obj: Any) -> Bus:
    if not isinstance(obj, Bus) and callable(obj):
        try:
            obj = obj()
            if inspect.isawaitable(obj):
                obj = await obj
        except Exception as exc:
            fail(f"calling the factory failed: {type(exc).__name__}: {exc}")
    if not isinstance(obj, Bus):
        fail(f"expected a nmbus.Bus (or a function returning one), got {type(obj).__name__}", 2)
    return obj


async def serve(obj: Any) -> int:
    """Start the bus, wait for SIGTERM/SIGINT, stop it gracefully. Returns the exit code."""
    bus = await _resolve(obj)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log.warning("shutdown_in_progress", signal=signal.Signals(signum).name)
            return
        log.info("shutdown_requested", signal=signal.Signals(signum).name, queue=bus.endpoint)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        if not await _started(bus, stop):
            log.info("worker_exited", queue=bus.endpoint)
            return 0
        async with _running(bus):
            log.info("worker_ready", queue=bus.endpoint, pid=os.getpid())
            waiters = [
                asyncio.create_task(stop.wait()),
                asyncio.create_task(bus.wait_stopped()),
            ]
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters:
                waiter.cancel()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    log.info("worker_exited", queue=bus.endpoint)
    return 0


async def _started(bus: Bus, stop: asyncio.Event) -> bool:
    """Start ``bus``; False when told to stop first (a start may wait for a free
    connection for as long as the server has none: nmbus.bus.Bus.start)."""
    starting = asyncio.create_task(bus.start())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if not starting.done():
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        return False
    starting.result()  # its failure, if it failed
    return True


@contextlib.asynccontextmanager
async def _running(bus: Bus) -> AsyncIterator[Bus]:
    """A started ``bus``, stopped gracefully however the block ends."""
    try:
        yield bus
    finally:
        await asyncio.shield(bus.stop())


@app.command()
def worker(
    target: Annotated[
        str, typer.Argument(metavar="MODULE:BUS", help="import path of a Bus or a Bus factory")
    ],
    log_level: Annotated[
        LogLevel | None,
        typer.Option(case_sensitive=False, help="as the global --log-level (default here: info)"),
    ] = None,
    log_format: Annotated[
        LogFormat | None,
        typer.Option(case_sensitive=False, help="as the global --log-format"),
    ] = None,
) -> None:
    """Run a Bus's workers. SIGTERM or SIGINT: finish in-flight handlers, exit 0."""
    # A worker says when it is ready and when it stops: info, unless told otherwise
    # here or before the command (nmbus --log-level ... worker).
    configure_logging(
        log_level or options.log_level or LogLevel.info, log_format or options.log_format
    )
    obj = load_bus(target)
    code = asyncio.run(serve(obj))
    raise typer.Exit(code)
