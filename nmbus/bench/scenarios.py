"""The benchmarks themselves: each mode of ``nmbus bench`` measured once, on a scratch schema.

:mod:`nmbus.bench.runner` runs them, repeats them and gathers their figures;
the modes are described there.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import asyncpg

from nmbus.bench.scratch import QUEUE, BenchOptions, Scratch, Tick, load_segments
from nmbus.bench.sql import render
from nmbus.bus import Bus
from nmbus.context import Context
from nmbus.postgres import sql as core_sql
from nmbus.postgres.floor import read_floor
from nmbus.postgres.store import WORKER_SERVER_SETTINGS


async def wait_until(check: Callable[[], bool], timeout: float, step: float = 0.005) -> None:
    # The worker's counters have no event to wait on; a 5 ms poll costs next to nothing.
    async with asyncio.timeout(timeout):
        while not check():  # noqa: ASYNC110
            await asyncio.sleep(step)


async def open_loop(
    send: Callable[[int], Coroutine[Any, Any, None]], rate: float, total: int
) -> None:
    """Call ``send(0)`` to ``send(total - 1)`` at ``rate`` per second, each in a
    task of its own, never waiting for one send before starting the next."""
    interval = 1.0 / rate
    tasks: list[asyncio.Task[None]] = []
    begin = time.perf_counter()
    for n in range(total):
        wait = begin + n * interval - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(send(n)))
    await asyncio.gather(*tasks)


def drain_timeout(count: int) -> float:
    """Seconds a run of ``count`` messages may take before the benchmark gives up.

    Generous: a loaded machine must not turn a slow run into a failure.
    """
    return 60.0 + count / 200.0


# -- ceiling ----------------------------------------------------------------------------


async def measure_ceiling(
    options: BenchOptions,
    scratch: Scratch,
    *,
    safe: bool = False,
    single: bool = False,
    loops: int | None = None,
    cpu_used: list[float] | None = None,
) -> float:
    """Messages per second of a bare asyncpg loop, ``loops`` (default ``concurrency``) of them.

    One-statement (neither flag): claim and mark X in one autocommitted
    statement per batch, what a queue that forgets a message its worker died
    on can do at best. Crash-safe (``safe=True``): the two writes nmbus itself
    makes, with nmbus's own statements: a claim that counts the attempt and
    takes a lease, then one statement per batch that marks the batch X and
    claims the next one. No decoding, no handler, no framework: the limit of
    nmbus's design on this server. Single-write (``single=True``): a claim that
    writes each row once, the design nmbus does not have (docs/performance.md):
    the batch's transaction locks its rows, a record of them is committed on a
    second connection before the handlers would run (crash accounting), and
    one UPDATE counts the attempt, marks X and drops the record at the commit.
    """
    await scratch.create_queue()
    await scratch.preload(options.messages)
    await scratch.checkpoint()
    count = options.concurrency if loops is None else loops
    batch, lease, client = options.claim_size, 60.0, "bench-ceiling"
    done = 0
    record = ""

    async def one_statement(conn: asyncpg.Connection, _: int) -> None:
        nonlocal done
        while rows := await conn.fetch(statements[0], batch):
            done += len(rows)

    async def crash_safe(conn: asyncpg.Connection, index: int) -> None:
        nonlocal done
        claim, finish = statements
        # Each claim under a token of its own, as a worker's (nmbus/consume/claim.py).
        tokens = (f"{client}/{index}.{n}" for n in itertools.count(1))
        token = next(tokens)
        rows = await conn.fetch(claim, batch, token, lease, floor)
        while rows:
            ids = [r[0] for r in rows]
            token, finished = next(tokens), token
            rows = await conn.fetch(finish, ids, finished, batch, lease, floor, token)
            done += rows[0]["finished"]
            if rows[0][0] is None:
                return

    async def single_write(conn: asyncpg.Connection, index: int) -> None:
        nonlocal done
        claim, finish = statements
        side = sides[index]
        holder = secrets.randbits(62)  # the advisory lock that says this loop lives
        while True:
            async with conn.transaction():
                rows = await conn.fetch(claim, batch, holder)
                if not rows:
                    return
                ids = [r[0] for r in rows]
                number = await side.fetchval(record, holder, ids)
                await conn.execute(finish, ids, number)
            done += len(rows)

    loop: Callable[[asyncpg.Connection, int], Coroutine[Any, Any, None]]
    if single:
        await scratch.c.execute(render("bench_single_write_create", scratch.schema))
        names = ("bench_single_write_claim", "bench_single_write_finish")
        statements = [render(name, scratch.schema, QUEUE) for name in names]
        record = render("bench_single_write_record", scratch.schema)
        loop = single_write
    elif safe:
        names = ("claim", "finish_claim_processed")
        statements = [core_sql.render(name, scratch.schema, QUEUE) for name in names]
        loop = crash_safe
    else:
        statements = [render("bench_ceiling", scratch.schema, QUEUE)]
        loop = one_statement
    floor = await read_floor(scratch.c, scratch.schema, QUEUE)
    conns: list[asyncpg.Connection] = []
    sides: list[asyncpg.Connection] = []
    try:
        for _ in range(count):
            # The server settings of a worker connection (its plans), as nmbus's own workers.
            conns.append(await asyncpg.connect(options.dsn, server_settings=WORKER_SERVER_SETTINGS))
        for _ in range(count if single else 0):
            sides.append(await asyncpg.connect(options.dsn))
        # Prepared outside the timed part, as asyncpg's statement cache would be.
        for conn in conns:
            for statement in statements:
                await conn.prepare(statement)
        for conn in sides:
            await conn.prepare(record)
        cpu = time.process_time()
        started = time.perf_counter()
        await asyncio.gather(*(loop(c, i) for i, c in enumerate(conns)))
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu
    finally:
        for conn in conns + sides:
            await conn.close()
    if done != options.messages:
        raise RuntimeError(f"ceiling loop marked {done} rows, expected {options.messages}")
    if single:
        await _check_single_write(scratch, options.messages)
    if cpu_used is not None:
        cpu_used.append(cpu * 1e6 / done)
    return done / elapsed


async def _check_single_write(scratch: Scratch, messages: int) -> None:
    """The single-write loop checks itself: each row marked X once, its attempt
    counted once, and no batch's record left behind."""
    rows = [
        tuple(r) for r in await scratch.c.fetch(render("bench_attempts", scratch.schema, QUEUE))
    ]
    left = await scratch.c.fetchval(render("bench_single_write_left", scratch.schema))
    if rows != [("X", 1, messages)] or left:
        raise RuntimeError(
            f"the single-write loop left rows {rows} (subqueue, attempts, count) and {left} "
            f"records, expected [('X', 1, {messages})] and none"
        )


# -- drain and transactional ----------------------------------------------------------


async def measure_drain(
    options: BenchOptions,
    scratch: Scratch,
    *,
    transactional: bool = False,
    x_rows: int = 0,
    count: int | None = None,
    cpu_used: list[float] | None = None,
    loops: int | None = None,
    outside_effects: bool = True,
) -> float:
    """Messages per second of a Bus worker draining ``count`` pre-loaded messages.

    With ``cpu_used``, also appends this process's CPU microseconds per message:
    the Python cost, which a busy machine disturbs far less than the wall clock.
    """
    total = options.messages if count is None else count
    await scratch.create_queue()
    if x_rows:
        await load_segments(scratch, x_rows, options.segments)
    if transactional:
        await scratch.c.execute(render("bench_create_effects", scratch.schema))
    await scratch.preload(total)
    await scratch.checkpoint()

    extra = {} if loops is None else {"concurrency": loops}
    bus = Bus(QUEUE, settings=options.bus_settings(scratch.schema, **extra))
    first: list[float] = []
    insert_effect = render("bench_insert_effect", scratch.schema)

    if transactional:

        @bus.handler(outside_effects=outside_effects)
        async def effect(msg: Tick, ctx: Context) -> None:
            if not first:
                first.append(time.perf_counter())
            await ctx.connection.execute(insert_effect, ctx.message_id, msg.n)

    else:

        @bus.handler
        async def noop(msg: Tick, ctx: Context) -> None:
            if not first:
                first.append(time.perf_counter())

    async with bus:
        cpu = time.process_time()
        await wait_until(lambda: bus.worker.handled >= total, drain_timeout(total))
        elapsed = time.perf_counter() - first[0]
        cpu = time.process_time() - cpu
    if cpu_used is not None:
        cpu_used.append(cpu * 1e6 / total)
    processed = await scratch.count("X") - x_rows
    if processed != total:
        raise RuntimeError(f"drain processed {processed} messages, expected {total}")
    if transactional:
        effects = int(await scratch.c.fetchval(render("bench_count_effects", scratch.schema)))
        if effects != total:
            raise RuntimeError(f"handlers wrote {effects} effects, expected {total}")
    return total / elapsed


async def measure_per_message_transactions(options: BenchOptions, scratch: Scratch) -> float:
    """The baseline: every message in a transaction of its own (claim one, insert, X, commit)."""
    await scratch.create_queue()
    await scratch.c.execute(render("bench_create_effects", scratch.schema))
    total = options.baseline_messages
    await scratch.preload(total)
    await scratch.checkpoint()
    claim = render("bench_claim_one", scratch.schema, QUEUE)
    insert = render("bench_insert_effect", scratch.schema)
    mark = render("bench_mark_one", scratch.schema, QUEUE)
    conn = await asyncpg.connect(options.dsn)
    done = 0
    try:
        started = time.perf_counter()
        while True:
            async with conn.transaction():
                row = await conn.fetchrow(claim)
                if row is None:
                    break
                msg = Tick.model_validate_json(row["msg_text"])
                await conn.execute(insert, row["id"], msg.n)
                await conn.execute(mark, row["id"])
            done += 1
        elapsed = time.perf_counter() - started
    finally:
        await conn.close()
    if done != total:
        raise RuntimeError(f"baseline handled {done} messages, expected {total}")
    return done / elapsed


# -- latency ----------------------------------------------------------------------------


def with_setting(dsn: str, name: str, value: str) -> str:
    """``dsn`` with a server setting for its connections (asyncpg passes unknown
    query parameters on as server settings)."""
    from urllib.parse import quote

    return f"{dsn}{'&' if '?' in dsn else '?'}{quote(name)}={quote(value)}"


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between closest ranks."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    pos = (len(ordered) - 1) * q / 100.0
    lower = int(pos)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (pos - lower)


async def measure_latency(
    options: BenchOptions, scratch: Scratch, *, worker_async_commit: bool = False
) -> dict[str, float]:
    """Send at ``rate`` per second for ``seconds``; milliseconds from send to handler start.

    ``worker_async_commit``: the worker's connections run with
    ``synchronous_commit=off`` (the sender's stay as the server says), so its
    claim does not wait for a WAL flush (docs/performance.md says what that costs).

    Sends are scheduled open-loop (each in its own task at its due time, on the
    producer's pool), so a slow send delays no other. Two clocks are kept: from
    the call of ``send`` (what a caller waits for: INSERT + COMMIT + the worker's
    wake-up and claim) and from its return (the commit is durable: wake-up and claim).
    """
    await scratch.create_queue()
    started_at: dict[int, float] = {}
    extra = {"dsn": with_setting(options.dsn, "synchronous_commit", "off")}
    worker = Bus(
        QUEUE, settings=options.bus_settings(scratch.schema, **extra if worker_async_commit else {})
    )

    @worker.handler
    async def record(msg: Tick, ctx: Context) -> None:
        started_at[msg.n] = time.perf_counter()

    producer = Bus(
        "bench_producer",
        settings=options.bus_settings(scratch.schema, concurrency=0, send_pool_size=8),
    )
    total = max(1, int(options.rate * (options.seconds + options.warmup)))
    skip = int(options.rate * options.warmup)
    called: dict[int, float] = {}
    returned: dict[int, float] = {}

    async def send(n: int) -> None:
        called[n] = time.perf_counter()
        await producer.send(Tick(n=n, sent=called[n]), to=QUEUE)
        returned[n] = time.perf_counter()

    async with worker, producer:
        await asyncio.sleep(0.2)  # let the worker's listener connect
        await open_loop(send, options.rate, total)
        await wait_until(lambda: len(started_at) >= total, drain_timeout(total))
    counted = range(skip, total) if total > skip else range(total)
    return latency_figures(started_at, called, returned, counted)


def latency_figures(
    started_at: dict[int, float],
    called: dict[int, float],
    returned: dict[int, float],
    counted: range,
) -> dict[str, float]:
    """Percentiles, in ms, from each send's call (and return) to its handler's start."""
    from_call = [(started_at[n] - called[n]) * 1000.0 for n in counted]
    from_commit = [(started_at[n] - returned[n]) * 1000.0 for n in counted]
    send_ms = [(returned[n] - called[n]) * 1000.0 for n in counted]
    return {
        "p50_ms": percentile(from_call, 50),
        "p95_ms": percentile(from_call, 95),
        "p99_ms": percentile(from_call, 99),
        "max_ms": max(from_call),
        "after_commit_p50_ms": percentile(from_commit, 50),
        "after_commit_p99_ms": percentile(from_commit, 99),
        "send_p50_ms": percentile(send_ms, 50),
        "send_p99_ms": percentile(send_ms, 99),
        "samples": float(len(from_call)),
    }


# -- X rows -----------------------------------------------------------------------------


async def explain_claim(options: BenchOptions, scratch: Scratch) -> str:
    """``EXPLAIN (ANALYZE, BUFFERS)`` of the worker's claim, rolled back afterwards."""
    sql = "EXPLAIN (ANALYZE, BUFFERS) " + core_sql.render("claim", scratch.schema, QUEUE)
    tx = scratch.c.transaction()
    await tx.start()
    try:
        floor = await read_floor(scratch.c, scratch.schema, QUEUE)
        rows = await scratch.c.fetch(sql, options.claim_size, "bench-explain", 60.0, floor)
    finally:
        await tx.rollback()
    return "\n".join(r[0] for r in rows)
