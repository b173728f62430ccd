"""``nmbus bench saga``: messages per second through a saga against the same handler without.

Kept apart from :mod:`nmbus.bench.runner` (which calls :func:`measure_saga` for
the ``saga`` mode). Both runs drain the same
pre-loaded messages with the same settings in the same scratch schema: one
with a handler that counts into a saga's state (lock, load, save on every
message, ``sagas`` sagas keyed by ``n % sagas``), one with the same handler
body and no saga. The ratio is the figure to read; the rates depend on the
machine.

Then the same saga handler under contention (:func:`measure_contended`):
``--processes`` worker processes of ``--concurrency`` loops each drain the
messages into ``--sagas`` sagas (few sagas: every batch needs the same rows).
The processes start first; then the messages are stored and the queue analyzed
in one transaction, and all loops woken at once. Its figures are the wall time
from the first handler call to the last commit (each process says how many
messages it has done and when; the bench reads no table meanwhile), messages
per second, the deadlocks PostgreSQL counted in the database meanwhile
(``pg_stat_database.deadlocks``, read after the processes have exited, so each
has flushed its statistics) and the messages that ended in F. The sagas must
have counted every message once: a lost update fails the run.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid

from pydantic import BaseModel

from nmbus.bench.scenarios import drain_timeout, wait_until
from nmbus.bench.scratch import QUEUE, TICK, BenchOptions, Scratch, Tick
from nmbus.bench.sql import render
from nmbus.bus import Bus
from nmbus.context import Context
from nmbus.postgres.listen import notify_channel

DEADLOCKS = "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"

SAGAS = 100


class TickCount(BaseModel):
    count: int = 0
    last: int = 0


async def _drain(options: BenchOptions, scratch: Scratch, kind: str) -> float:
    total = options.messages
    await scratch.create_queue()
    await scratch.preload(total)
    await scratch.checkpoint()
    bus = Bus(QUEUE, settings=options.bus_settings(scratch.schema))
    first: list[float] = []
    counts: dict[int, TickCount] = {}
    with_saga = kind == "saga"
    bump = render("bench_bump_counter", scratch.schema)
    if kind == "table":
        await scratch.c.execute(render("bench_create_counters", scratch.schema))

        @bus.handler
        async def by_hand(msg: Tick, ctx: Context) -> None:
            if not first:
                first.append(time.perf_counter())
            await ctx.connection.execute(bump, msg.n % SAGAS)

    elif with_saga:
        saga = bus.saga(TickCount, key=lambda msg: msg.n % SAGAS)

        @saga.handler(start=True)
        async def in_saga(msg: Tick, state: TickCount, ctx: Context) -> None:
            if not first:
                first.append(time.perf_counter())
            state.count += 1
            state.last = msg.n

    else:

        @bus.handler
        async def plain(msg: Tick, ctx: Context) -> None:
            if not first:
                first.append(time.perf_counter())
            state = counts.setdefault(msg.n % SAGAS, TickCount())
            state.count += 1
            state.last = msg.n

    async with bus:
        # Counted in X: with several loops, the hand-written table's upserts can
        # deadlock, and a message that lost one is handled again from R.
        await wait_until(lambda: bus.worker.outcomes["X"] >= total, drain_timeout(total))
        elapsed = time.perf_counter() - first[0]
        if with_saga:
            states = [await saga.load(k) for k in range(min(SAGAS, total))]
            counted = sum(state.count for state in states if state is not None)
            if counted != total:
                raise RuntimeError(f"the sagas counted {counted} messages, expected {total}")
    processed = await scratch.count("X")
    if processed != total:
        raise RuntimeError(f"saga bench processed {processed} messages, expected {total}")
    return total / elapsed


async def measure_saga(options: BenchOptions, fresh: type[Scratch]) -> dict[str, float]:
    """Saga vs plain handler, each drained in a scratch schema of its own; then contention."""
    rates: dict[str, float] = {}
    for kind in ("plain", "table", "saga"):
        async with fresh(options.dsn) as scratch:
            rates[kind] = await _drain(options, scratch, kind)
    async with fresh(options.dsn) as scratch:
        contended = await measure_contended(options, scratch)
    return {
        "saga_per_s": rates["saga"],
        "plain_per_s": rates["plain"],
        "hand_written_table_per_s": rates["table"],
        "ratio_saga_to_plain": rates["saga"] / rates["plain"],
        "ratio_saga_to_hand_written": rates["saga"] / rates["table"],
        **contended,
    }


def _counting_bus(
    dsn: str, schema: str, batch_size: int | None, loops: int, sagas: int
) -> tuple[Bus, list[float]]:
    """The bench's saga endpoint (every Tick counts into saga ``n % sagas``), and when
    its first handler call was."""
    options = BenchOptions(dsn=dsn, batch_size=batch_size)
    bus = Bus(QUEUE, settings=options.bus_settings(schema, concurrency=loops))
    saga = bus.saga(TickCount, key=lambda msg: msg.n % sagas)

    first: list[float] = []

    @saga.handler(start=True)
    async def count(msg: Tick, state: TickCount, ctx: Context) -> None:
        if not first:
            first.append(time.time())
        state.count += 1
        state.last = msg.n

    return bus, first


async def measure_contended(options: BenchOptions, scratch: Scratch) -> dict[str, float]:
    """``processes`` x ``concurrency`` saga loops on ``sagas`` sagas: time, deadlocks, F."""
    total, processes, sagas = options.messages, options.processes, options.sagas
    await scratch.create_queue()
    # The saga table, made before the processes start.
    async with _counting_bus(options.dsn, scratch.schema, options.batch_size, 0, sagas)[0]:
        pass
    await scratch.checkpoint()
    deadlocks_before = int(await scratch.c.fetchval(DEADLOCKS))
    env = {**os.environ, "NMBUS_DSN": options.dsn}
    args = [sys.executable, "-m", "nmbus.bench.saga", scratch.schema]
    args += [str(options.batch_size or 0), str(options.concurrency), str(sagas)]
    procs = [
        await asyncio.create_subprocess_exec(
            *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env
        )
        for _ in range(processes)
    ]
    done: dict[int, tuple[int, float]] = {}  # process: (messages done, when)
    finished = asyncio.Event()
    died: list[int] = []
    lines: dict[int, list[str]] = {i: [] for i in range(processes)}

    async def follow(i: int, proc: asyncio.subprocess.Process) -> None:
        # Each process says how many messages it has done and when that changed;
        # the bench reads no table while they work (a count of the done rows read
        # the whole queue each poll, on the cores the workers share).
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode().strip()
            if line.startswith("done "):
                _, count, when = line.split()
                done[i] = (int(count), float(when))
                if sum(count for count, _ in done.values()) >= total:
                    finished.set()
            else:
                lines[i].append(line)
        if not finished.is_set():
            died.append(i)  # its output ended before the messages were done
            finished.set()

    readers: list[asyncio.Task[None]] = []
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 120)
            if line.strip() != b"ready":
                raise RuntimeError(f"bench saga process did not start: {line!r}")
        readers = [asyncio.create_task(follow(i, proc)) for i, proc in enumerate(procs)]
        # Every loop of every process is up and idle: the messages arrive in one
        # statement, and a wake-up sends all loops at them at once (start-up costs
        # are not in the figures).
        # Analyzed in the transaction that stores them, so the workers' first claim
        # already plans for them, as in the drain modes: planned for the empty queue,
        # each claim read the whole table until the workers' own analyze (up to a
        # second in), which slowed runs by up to a third, at random
        # (docs/performance.md, "Sagas on several loops, a tenth sitting").
        prefix = f"I{uuid.uuid4().hex[:8]}-"
        async with scratch.c.transaction():
            await scratch.c.execute(
                render("bench_preload", scratch.schema, QUEUE), total, "I", TICK, prefix
            )
            await scratch.c.execute(render("seed_analyze", scratch.schema, QUEUE))
        await scratch.c.execute("SELECT pg_notify($1, $2)", notify_channel(scratch.schema), QUEUE)
        try:
            await asyncio.wait_for(finished.wait(), drain_timeout(total) + 300)
        except TimeoutError:
            raise RuntimeError("the saga processes did not finish in time") from None
        if died:
            raise RuntimeError(f"bench saga process {died[0] + 1} of {processes} ended early")
        ended = max(when for _, when in done.values())
        reports = []
        for i, proc in enumerate(procs):
            assert proc.stdin is not None
            proc.stdin.write(b"stop\n")
            await proc.stdin.drain()
            await asyncio.wait_for(proc.wait(), 60)
            await readers[i]
            reports.append(json.loads(lines[i][-1]))
    finally:
        for task in readers:
            task.cancel()
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    # Each process flushed its statistics when it exited; the collector may lag a moment.
    await asyncio.sleep(1.0)
    await scratch.c.execute("SELECT pg_stat_clear_snapshot()")
    deadlocks = int(await scratch.c.fetchval(DEADLOCKS)) - deadlocks_before
    failed = await scratch.count("F")
    if await scratch.count("X") + failed != total:
        raise RuntimeError("the saga processes said they were done with messages still to do")
    started = min(r["first"] for r in reports if r["first"] is not None)
    elapsed = ended - started
    bus, _ = _counting_bus(options.dsn, scratch.schema, options.batch_size, 0, sagas)
    async with bus:
        saga = bus.sagas["TickCount"]
        states = [await saga.load(k) for k in range(min(sagas, total))]
    counted = sum(state.count for state in states if state is not None)
    if counted != total - failed:
        raise RuntimeError(
            f"the sagas counted {counted} messages, expected {total - failed}: updates were lost"
        )
    return {
        "contended_wall_s": elapsed,
        "contended_per_s": total / elapsed,
        "contended_deadlocks": float(deadlocks),
        "contended_messages_in_f": float(failed),
    }


async def _work(schema: str, batch_size: int, loops: int, sagas: int) -> None:
    size = batch_size or None  # 0: adaptive
    bus, first = _counting_bus(os.environ["NMBUS_DSN"], schema, size, loops, sagas)
    read = asyncio.get_running_loop().run_in_executor
    async with bus:
        print("ready", flush=True)
        progress = asyncio.create_task(_report_done(bus))
        await read(None, sys.stdin.readline)
        progress.cancel()
    report = {"first": first[0] if first else None, "handled": bus.worker.handled}
    print(json.dumps(report), flush=True)


async def _report_done(bus: Bus) -> None:
    """Print ``done <messages in X or F> <when>`` each time that count changes
    (looked at every 5 ms: the time of the last commit to within that)."""
    seen = 0
    while True:
        await asyncio.sleep(0.005)
        count = bus.worker.outcomes["X"] + bus.worker.outcomes["F"]
        if count != seen:
            seen = count
            print(f"done {count} {time.time()}", flush=True)


if __name__ == "__main__":
    import logging

    import structlog

    # Warnings and errors to stderr, as ``nmbus bench`` itself; stdout is for the report.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    asyncio.run(_work(sys.argv[1], *(int(a) for a in sys.argv[2:5])))
