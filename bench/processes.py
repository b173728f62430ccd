"""The drain by several worker processes at once (``python -m bench scaling``).

The bench starts ``processes`` copies of this module (``python -m
bench.processes SCHEMA``, the DSN in ``NMBUS_DSN`` so that it never shows in a
process list, the repository's root on ``PYTHONPATH`` so that bench/ imports
wherever the bench was started from). Each builds a Bus with a no-op handler on
the bench's queue, opens its store, says ``ready``, waits for ``go`` on its
standard input, then drains in burst mode (one worker loop, the same claim and
finish as ``async with bus``) until nothing is ready, and prints when it started
and ended, in wall-clock seconds, with what it handled. The rate is the messages
of all processes over the time from the first start to the last end.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from nmbus.bench.scratch import QUEUE, BenchOptions, Scratch, Tick
from nmbus.bus import Bus
from nmbus.context import Context

#: The repository's root, where bench/ is.
ROOT = Path(__file__).resolve().parent.parent


@asynccontextmanager
async def worker_processes(
    dsn: str, module: list[str], count: int
) -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """``count`` processes of ``python -m <module...>`` (the DSN in NMBUS_DSN, never in a
    process list), each having said ``ready``; any left running is killed on the way out."""
    path = os.environ.get("PYTHONPATH")
    root = str(ROOT) + (os.pathsep + path if path else "")
    env = {**os.environ, "NMBUS_DSN": dsn, "PYTHONPATH": root}
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            *module,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        for _ in range(count)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 120)
            if line.strip() != b"ready":
                raise RuntimeError(f"bench worker process did not start: {line!r}")
        yield procs
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def go_and_report(procs: list[asyncio.subprocess.Process], timeout: float) -> list[Any]:
    """Say ``go`` to every process, then read the JSON each prints last."""
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
    reports = []
    for proc in procs:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        reports.append(json.loads(out.decode().strip().splitlines()[-1]))
        if proc.returncode != 0:
            raise RuntimeError(f"bench worker process exited with {proc.returncode}")
    return reports


async def measure_processes(options: BenchOptions, scratch: Scratch, *, processes: int) -> float:
    """Messages per second of ``processes`` worker processes draining ``messages`` rows."""
    total = options.messages
    await scratch.create_queue()
    await scratch.preload(total)
    await scratch.checkpoint()
    module = ["bench.processes", scratch.schema, str(options.batch_size)]
    async with worker_processes(options.dsn, module, processes) as procs:
        reports = await go_and_report(procs, 60 + total / 200)
    handled = sum(r["handled"] for r in reports)
    processed = await scratch.count("X")
    if handled != total or processed != total:
        raise RuntimeError(f"{processes} processes handled {handled}, expected {total}")
    elapsed = float(max(r["ended"] for r in reports)) - float(min(r["started"] for r in reports))
    return total / elapsed


async def _work(schema: str, batch_size: int) -> None:
    options = BenchOptions(dsn=os.environ["NMBUS_DSN"], batch_size=batch_size)
    bus = Bus(QUEUE, settings=options.bus_settings(schema, concurrency=0))

    @bus.handler
    async def noop(msg: Tick, ctx: Context) -> None:
        pass

    await bus.store.open()
    try:
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        started = time.time()
        counts = await bus.worker.run_burst()
        ended = time.time()
    finally:
        await bus.store.close()
    print(json.dumps({"started": started, "ended": ended, "handled": counts["X"]}), flush=True)


if __name__ == "__main__":
    import logging

    import structlog

    # Warnings and errors to stderr, as ``python -m bench`` itself; stdout is for the report.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    asyncio.run(_work(sys.argv[1], int(sys.argv[2])))
