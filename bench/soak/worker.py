"""One worker process of the kill soak (:mod:`bench.soak` starts and kills them).

Its handler, before it may fail, writes ``(unique_id, attempt, pid)`` to
``soak_effects`` through ``ctx.connection`` (transactional), then fails
``fail_rate`` of the time, and after succeeding appends ``ok unique_id
attempt`` to ``<log_dir>/<pid>.log`` with one unbuffered ``O_APPEND`` write
(not transactional: it survives a SIGKILL). A poison message's handler
SIGKILLs its own process. :mod:`bench.soak.report` reads both back.

Started as ``python -c`` with :data:`ENTRY`, never ``-m``: that would define
SoakWork a second time, in ``__main__``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sys
from pathlib import Path

from bench.sql import render
from nmbus.bus import Bus
from nmbus.context import Context
from nmbus.errors import NmbusError
from nmbus.messages import Message
from nmbus.settings import Settings

QUEUE = "soak"
ENTRY = "import sys; from bench.soak.worker import main; main(sys.argv[1:])"


class SoakWork(Message, type_name="nmbus.soak.Work"):
    """One unit of soak work."""

    n: int
    poison: bool = False


class SoakFailure(NmbusError):
    """The soak handler's injected failure: an ordinary one, retried by the policy."""


async def _worker(dsn: str, schema: str, logs: Path, options: dict[str, float]) -> None:
    pid = os.getpid()
    fd = os.open(logs / f"{pid}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    fail_rate, sleep_rate, sleep_max = (
        options["fail_rate"],
        options["sleep_rate"],
        options["sleep_max"],
    )
    bus = Bus(
        QUEUE,
        settings=Settings(
            dsn=dsn,
            schema_name=schema,
            concurrency=int(options["concurrency"]),
            batch_size=int(options["batch_size"]),
            lease_seconds=options["lease"],
            poll_interval=0.5,
            max_attempts=int(options["max_attempts"]),
            retry_delay=0.05,
            retry_max_delay=0.5,
            reconnect_max_delay=1.0,
        ),
    )
    record = render("soak_record_effect", schema)

    @bus.handler
    async def handle(msg: SoakWork, ctx: Context) -> None:
        if msg.poison:
            os.write(fd, f"poison {ctx.unique_id} {ctx.retry_count}\n".encode())
            os.kill(pid, signal.SIGKILL)
        if random.random() < sleep_rate:
            await asyncio.sleep(random.uniform(0, sleep_max))
        await ctx.connection.execute(record, ctx.unique_id, ctx.retry_count, pid)
        if random.random() < fail_rate:
            os.write(fd, f"fail {ctx.unique_id} {ctx.retry_count}\n".encode())
            raise SoakFailure(f"injected failure of message {msg.n}")
        os.write(fd, f"ok {ctx.unique_id} {ctx.retry_count}\n".encode())

    loop = asyncio.get_running_loop()
    async with bus:
        loop.add_signal_handler(signal.SIGTERM, lambda: asyncio.ensure_future(bus.stop()))
        print("ready", flush=True)
        await bus.wait_stopped()


def _configure_worker_logging() -> None:
    import logging

    import structlog

    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def main(argv: list[str]) -> None:
    if not argv or argv[0] != "worker":
        raise SystemExit("usage: (python -c ENTRY) worker DSN SCHEMA LOG_DIR key=value...")
    dsn, schema, logs = argv[1], argv[2], Path(argv[3])
    options = {k: float(v) for k, v in (item.split("=", 1) for item in argv[4:])}
    _configure_worker_logging()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_worker(dsn, schema, logs, options))
