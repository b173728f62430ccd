"""Benchmarks of nmbus against a real PostgreSQL: what ``nmbus bench`` runs.

Every measurement runs in a schema of its own (``nmbus_bench_<random>``) that it
creates and drops, so it never touches the queues of the database it is pointed
at. The modes:

``ceiling``        the bare asyncpg loop nmbus is measured against: claim up to a
                   batch of ready rows with ``FOR UPDATE SKIP LOCKED`` and mark
                   them X, one autocommitted statement per batch.
``drain``          pre-load N messages, time a worker draining them with a typed
                   no-op handler.
``transactional``  the same, the handler inserting one row through
                   ``ctx.connection``; compared with a loop that gives every
                   message its own transaction (claim one, insert, mark X, commit).
``latency``        a producer on its own connections sends at a fixed rate; the
                   time from send to handler start, as percentiles.
``fanout``         publishers call ``Bus.publish``, then ``Bus.publish_many`` in
                   batches, to 3 subscribers; published
                   messages and stored rows per second.
``xrows``          drain on an empty table, then with millions of X rows in the
                   same table, and ``EXPLAIN (ANALYZE, BUFFERS)`` of the claim.
``delivery``       in one run: a plain drain, a drain with priorities mixed 0-9,
                   and a drain of ``sequences`` sequences of ``sequence_members``
                   each (interleaved), as rates and ratios to the plain drain.

Figures are only as good as the machine is quiet: the load average is printed
with the settings of every run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import asyncpg

from nmbus.bus import Bus
from nmbus.context import Context
from nmbus.messages import Message, type_name
from nmbus.postgres.store import install_schema
from nmbus.settings import Settings
from nmbus.sql import render

MODES = ("ceiling", "drain", "transactional", "latency", "fanout", "xrows", "delivery")
ALL_MODES = ("ceiling", "drain", "transactional", "latency", "fanout")
QUEUE = "bench"


class Tick(Message, type_name="nmbus.bench.Tick"):
    """The message every benchmark sends: a number, and for latency a send time."""

    n: int
    sent: float = 0.0


TICK = type_name(Tick)


@dataclass
class BenchOptions:
    """What to measure and how much of it."""

    dsn: str = field(repr=False)  # it may hold a password
    messages: int = 50_000
    batch_size: int = 100
    concurrency: int = 1
    baseline_messages: int = 5_000
    rate: float = 200.0
    seconds: float = 10.0
    warmup: float = 1.0
    subscribers: int = 3
    publishers: int = 8
    fanout_messages: int = 10_000
    fanout_batch: int = 500
    x_rows: int = 5_000_000
    sequences: int = 50
    sequence_members: int = 1_000
    repeat: int = 1

    def bus_settings(self, schema: str, **extra: Any) -> Settings:
        values: dict[str, Any] = {
            "dsn": self.dsn,
            "schema_name": schema,
            "batch_size": self.batch_size,
            "concurrency": self.concurrency,
            "subscription_ttl": None,
            "poll_interval": 1.0,
        }
        values.update(extra)
        return Settings(**values)


@dataclass
class Result:
    """The figures of one mode: each a median over ``runs`` repetitions."""

    mode: str
    figures: dict[str, float] = field(default_factory=dict)
    units: dict[str, str] = field(default_factory=dict)
    runs: dict[str, list[float]] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, name: str, value: float, unit: str) -> None:
        self.runs.setdefault(name, []).append(value)
        self.units[name] = unit
        self.figures[name] = statistics.median(self.runs[name])

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


# -- helpers ---------------------------------------------------------------------------


class _Scratch:
    """A schema of the bench's own with one queue table; dropped on exit."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.schema = f"nmbus_bench_{uuid.uuid4().hex[:10]}"
        self.conn: asyncpg.Connection | None = None

    async def __aenter__(self) -> _Scratch:
        self.conn = await asyncpg.connect(self.dsn)
        await install_schema(self.conn, self.schema)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.conn is not None
        try:
            await self.conn.execute(render("bench_drop_schema", self.schema))
        finally:
            await self.conn.close()

    @property
    def c(self) -> asyncpg.Connection:
        assert self.conn is not None
        return self.conn

    async def create_queue(self, queue: str = QUEUE) -> None:
        async with self.c.transaction():
            await self.c.execute(render("create_queue", self.schema, queue))
            await self.c.execute(render("register_queue", self.schema), queue)

    async def preload(self, count: int, subqueue: str = "I", queue: str = QUEUE) -> None:
        if count <= 0:
            return
        prefix = f"{subqueue}{uuid.uuid4().hex[:8]}-"
        await self.c.execute(
            render("bench_preload", self.schema, queue), count, subqueue, TICK, prefix
        )
        await self.c.execute(render("bench_vacuum", self.schema, queue))

    async def checkpoint(self) -> None:
        """Flush what the pre-load dirtied, so no checkpoint lands in the timed part."""
        # Without the right to, figures may include a checkpoint (docs/performance.md).
        with contextlib.suppress(asyncpg.InsufficientPrivilegeError):
            await self.c.execute(render("bench_checkpoint", self.schema))

    async def count(self, subqueue: str, queue: str = QUEUE) -> int:
        sql = render("bench_count_subqueue", self.schema, queue)
        return int(await self.c.fetchval(sql, subqueue))


async def _wait_until(check: Callable[[], bool], timeout: float, step: float = 0.005) -> None:
    # The worker's counters have no event to wait on; a 5 ms poll costs next to nothing.
    async with asyncio.timeout(timeout):
        while not check():  # noqa: ASYNC110
            await asyncio.sleep(step)


def _deadline(count: int) -> float:
    # Generous: a loaded machine must not turn a slow run into a failure.
    return 60.0 + count / 200.0


# -- ceiling ----------------------------------------------------------------------------


async def measure_ceiling(options: BenchOptions, scratch: _Scratch) -> float:
    """Messages per second of the bare claim-and-mark-X loop, ``concurrency`` loops."""
    await scratch.create_queue()
    await scratch.preload(options.messages)
    await scratch.checkpoint()
    sql = render("bench_ceiling", scratch.schema, QUEUE)
    conns = [await asyncpg.connect(options.dsn) for _ in range(options.concurrency)]
    try:
        for conn in conns:  # prepare outside the timed part, as asyncpg's cache would
            await conn.prepare(sql)
        done = 0

        async def loop(conn: asyncpg.Connection) -> None:
            nonlocal done
            while True:
                rows = await conn.fetch(sql, options.batch_size)
                if not rows:
                    return
                done += len(rows)

        started = time.perf_counter()
        await asyncio.gather(*(loop(c) for c in conns))
        elapsed = time.perf_counter() - started
    finally:
        for conn in conns:
            await conn.close()
    if done != options.messages:
        raise RuntimeError(f"ceiling loop marked {done} rows, expected {options.messages}")
    return done / elapsed


# -- drain and transactional ----------------------------------------------------------


async def measure_drain(
    options: BenchOptions,
    scratch: _Scratch,
    *,
    transactional: bool = False,
    x_rows: int = 0,
    count: int | None = None,
    cpu_used: list[float] | None = None,
) -> float:
    """Messages per second of a Bus worker draining ``count`` pre-loaded messages.

    With ``cpu_used``, also appends this process's CPU microseconds per message:
    the Python cost, which a busy machine disturbs far less than the wall clock.
    """
    total = options.messages if count is None else count
    await scratch.create_queue()
    await scratch.preload(x_rows, "X")
    if transactional:
        await scratch.c.execute(render("bench_create_effects", scratch.schema))
    await scratch.preload(total)
    await scratch.checkpoint()

    bus = Bus(QUEUE, settings=options.bus_settings(scratch.schema))
    first: list[float] = []
    insert_effect = render("bench_insert_effect", scratch.schema)

    if transactional:

        @bus.handler
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
        await _wait_until(lambda: bus.worker.handled >= total, _deadline(total))
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


async def measure_per_message_transactions(options: BenchOptions, scratch: _Scratch) -> float:
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


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between closest ranks."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    pos = (len(ordered) - 1) * q / 100.0
    lower = int(pos)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (pos - lower)


async def measure_latency(options: BenchOptions, scratch: _Scratch) -> dict[str, float]:
    """Send at ``rate`` per second for ``seconds``; milliseconds from send to handler start.

    Sends are scheduled open-loop (each in its own task at its due time, on the
    producer's pool), so a slow send delays no other. Two clocks are kept: from
    the call of ``send`` (what a caller waits for: INSERT + COMMIT + the worker's
    wake-up and claim) and from its return (the commit is durable: wake-up and claim).
    """
    await scratch.create_queue()
    started_at: dict[int, float] = {}
    worker = Bus(QUEUE, settings=options.bus_settings(scratch.schema))

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
        interval = 1.0 / options.rate
        tasks: list[asyncio.Task[None]] = []
        begin = time.perf_counter()
        for n in range(total):
            wait = begin + n * interval - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(send(n)))
        await asyncio.gather(*tasks)
        await _wait_until(lambda: len(started_at) >= total, _deadline(total))
    counted = range(skip, total) if total > skip else range(total)
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


# -- fanout -----------------------------------------------------------------------------


async def measure_fanout(options: BenchOptions, scratch: _Scratch) -> dict[str, float]:
    """``publishers`` tasks call Bus.publish; every message goes to ``subscribers`` queues."""
    subscribers = [f"bench_sub_{i}" for i in range(1, options.subscribers + 1)]
    buses = []
    for name in subscribers:
        sub = Bus(name, settings=options.bus_settings(scratch.schema, concurrency=0))
        sub.subscribe(Tick, publisher="bench_pub")
        buses.append(sub)
    publisher = Bus(
        "bench_pub",
        settings=options.bus_settings(
            # One spare: Bus.publish holds a connection while ensure_queue may want
            # another for a subscriber queue it has not seen yet.
            scratch.schema,
            concurrency=0,
            send_pool_size=options.publishers + 1,
        ),
    )
    total = options.fanout_messages
    for sub in buses:
        await sub.start()
    try:
        async with publisher:
            await publisher.publish(Tick(n=-1))  # connections and caches warm, not timed
            counter = iter(range(total))

            async def publish_loop() -> None:
                for n in counter:
                    await publisher.publish(Tick(n=n))

            started = time.perf_counter()
            await asyncio.gather(*(publish_loop() for _ in range(options.publishers)))
            elapsed = time.perf_counter() - started

            # The same messages again through publish_many: one statement and one
            # commit per fanout_batch messages, every copy still in its own row.
            batches = iter(range(0, total, options.fanout_batch))

            async def publish_many_loop() -> None:
                for first in batches:
                    last = min(total, first + options.fanout_batch)
                    await publisher.publish_many([Tick(n=n) for n in range(first, last)])

            started = time.perf_counter()
            await asyncio.gather(*(publish_many_loop() for _ in range(options.publishers)))
            batched_elapsed = time.perf_counter() - started
    finally:
        for sub in buses:
            await sub.stop()
    for name in subscribers:
        stored = await scratch.count("I", name)
        if stored != 2 * total + 1:
            raise RuntimeError(f"subscriber {name} got {stored} rows, expected {2 * total + 1}")
    return {
        "published_per_s": total / elapsed,
        "rows_per_s": total * len(subscribers) / elapsed,
        "batched_published_per_s": total / batched_elapsed,
        "batched_rows_per_s": total * len(subscribers) / batched_elapsed,
    }


# -- X rows -----------------------------------------------------------------------------


async def explain_claim(options: BenchOptions, scratch: _Scratch) -> str:
    """``EXPLAIN (ANALYZE, BUFFERS)`` of the worker's claim, rolled back afterwards."""
    sql = "EXPLAIN (ANALYZE, BUFFERS) " + render("claim", scratch.schema, QUEUE)
    tx = scratch.c.transaction()
    await tx.start()
    try:
        rows = await scratch.c.fetch(sql, options.batch_size, "bench-explain", 60.0)
    finally:
        await tx.rollback()
    return "\n".join(r[0] for r in rows)


# -- the runner -------------------------------------------------------------------------


# -- delivery: priority and sequences (self-contained: moves as one block) -------------


async def measure_delivery_drain(
    options: BenchOptions, scratch: _Scratch, *, priorities: int = 1, sequences: int = 0
) -> float:
    """Messages per second of a worker draining rows with priorities 0..``priorities``-1
    and, when ``sequences`` > 0, all in that many interleaved sequences."""
    total = sequences * options.sequence_members if sequences else options.messages
    await scratch.create_queue()
    prefix = f"d{uuid.uuid4().hex[:8]}-"
    await scratch.c.execute(
        render("bench_preload_delivery", scratch.schema, QUEUE),
        total,
        TICK,
        prefix,
        priorities,
        sequences,
    )
    await scratch.c.execute(render("bench_vacuum", scratch.schema, QUEUE))
    await scratch.checkpoint()
    bus = Bus(QUEUE, settings=options.bus_settings(scratch.schema))
    first: list[float] = []

    @bus.handler
    async def noop(msg: Tick, ctx: Context) -> None:
        if not first:
            first.append(time.perf_counter())

    async with bus:
        await _wait_until(lambda: bus.worker.handled >= total, _deadline(total) * 4)
        elapsed = time.perf_counter() - first[0]
    processed = await scratch.count("X")
    if processed != total:
        raise RuntimeError(f"delivery drain processed {processed} messages, expected {total}")
    return total / elapsed


async def measure_delivery(options: BenchOptions, progress: Progress) -> dict[str, float]:
    """Plain, priority-mix and sequence drains in one run, with ratios to the plain one."""
    dsn = options.dsn
    progress("delivery: plain drain")
    plain = await _scratch_run(dsn, lambda s: measure_delivery_drain(options, s))
    progress("delivery: priorities 0-9")
    mixed = await _scratch_run(dsn, lambda s: measure_delivery_drain(options, s, priorities=10))
    progress(f"delivery: {options.sequences} sequences x {options.sequence_members}")
    seqs = await _scratch_run(
        dsn, lambda s: measure_delivery_drain(options, s, sequences=options.sequences)
    )
    return {
        "plain_messages_per_s": plain,
        "priority_mix_messages_per_s": mixed,
        "priority_ratio_to_plain": mixed / plain,
        "sequences_messages_per_s": seqs,
        "sequences_ratio_to_plain": seqs / plain,
    }


async def _server_settings(dsn: str) -> dict[str, Any]:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(render("bench_server", "nmbus"))
    finally:
        await conn.close()
    assert row is not None
    return {
        "server": str(row[0]).split(",")[0],
        "synchronous_commit": row[1],
        "shared_buffers": row[2],
        "fsync": row[3],
    }


def _machine() -> dict[str, Any]:
    load = os.getloadavg()
    return {
        "cpus": os.cpu_count(),
        "load_average_1m": round(load[0], 2),
        "python": platform.python_version(),
        "asyncpg": asyncpg.__version__,
    }


async def _scratch_run(dsn: str, body: Callable[[_Scratch], Awaitable[Any]]) -> Any:
    async with _Scratch(dsn) as scratch:
        return await body(scratch)


async def run(
    modes: Sequence[str], options: BenchOptions, progress: Progress = _quiet
) -> list[Result]:
    """Measure ``modes`` ``options.repeat`` times each; medians in each Result's figures."""
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown bench mode {mode!r}; choose from {', '.join(MODES)}")
    common = {**await _server_settings(options.dsn), **_machine()}
    results = {mode: Result(mode) for mode in modes}
    dsn = options.dsn
    needs_ceiling = any(m in modes for m in ("ceiling", "drain"))
    for rep in range(1, options.repeat + 1):
        ceiling = None
        if needs_ceiling:
            progress(f"ceiling, run {rep}")
            ceiling = await _scratch_run(dsn, lambda s: measure_ceiling(options, s))
            if "ceiling" in results:
                results["ceiling"].add("messages_per_s", ceiling, "msg/s")
        if "drain" in results:
            progress(f"drain, run {rep}")
            cpu: list[float] = []
            rate = await _scratch_run(dsn, partial(measure_drain, options, cpu_used=cpu))
            results["drain"].add("messages_per_s", rate, "msg/s")
            assert ceiling is not None
            results["drain"].add("ratio_to_ceiling", rate / ceiling, "x")
            results["drain"].add("python_cpu_us_per_msg", cpu[0], "us")
        if "transactional" in results:
            progress(f"transactional, run {rep}")
            cpu = []
            run_tx = partial(measure_drain, options, transactional=True, cpu_used=cpu)
            rate = await _scratch_run(dsn, run_tx)
            progress(f"per-message transactions, run {rep}")
            base = await _scratch_run(dsn, lambda s: measure_per_message_transactions(options, s))
            res = results["transactional"]
            res.add("messages_per_s", rate, "msg/s")
            res.add("per_message_tx_per_s", base, "msg/s")
            res.add("ratio_to_per_message_tx", rate / base, "x")
            res.add("python_cpu_us_per_msg", cpu[0], "us")
        if "latency" in results:
            progress(f"latency, run {rep}")
            figures = await _scratch_run(dsn, lambda s: measure_latency(options, s))
            for name, value in figures.items():
                unit = "ms" if name.endswith("_ms") else ""
                results["latency"].add(name, value, unit)
        if "fanout" in results:
            progress(f"fanout, run {rep}")
            figures = await _scratch_run(dsn, lambda s: measure_fanout(options, s))
            results["fanout"].add("published_per_s", figures["published_per_s"], "msg/s")
            results["fanout"].add("rows_per_s", figures["rows_per_s"], "rows/s")
            results["fanout"].add(
                "batched_published_per_s", figures["batched_published_per_s"], "msg/s"
            )
            results["fanout"].add("batched_rows_per_s", figures["batched_rows_per_s"], "rows/s")
        if "delivery" in results:
            figures = await measure_delivery(options, progress)
            for name, value in figures.items():
                unit = "x" if "ratio" in name else "msg/s"
                results["delivery"].add(name, value, unit)
        if "xrows" in results:
            progress(f"drain on an empty table, run {rep}")
            empty = await _scratch_run(dsn, lambda s: measure_drain(options, s))
            progress(f"loading {options.x_rows} X rows and draining, run {rep}")

            async def with_x(s: _Scratch) -> tuple[float, str]:
                rate = await measure_drain(options, s, x_rows=options.x_rows)
                await s.preload(options.batch_size)
                return rate, await explain_claim(options, s)

            loaded, plan = await _scratch_run(dsn, with_x)
            res = results["xrows"]
            res.add("empty_messages_per_s", empty, "msg/s")
            res.add("with_x_rows_messages_per_s", loaded, "msg/s")
            res.add("ratio_loaded_to_empty", loaded / empty, "x")
            res.notes = [f"EXPLAIN (ANALYZE, BUFFERS) of the claim with {options.x_rows} X rows:"]
            res.notes.append(plan)
    for mode, result in results.items():
        result.settings = {**_mode_settings(mode, options), **common, "repeat": options.repeat}
    return list(results.values())


def _mode_settings(mode: str, o: BenchOptions) -> dict[str, Any]:
    base = {"batch_size": o.batch_size, "concurrency": o.concurrency}
    if mode in ("ceiling", "drain"):
        return {**base, "messages": o.messages}
    if mode == "transactional":
        return {**base, "messages": o.messages, "baseline_messages": o.baseline_messages}
    if mode == "latency":
        return {**base, "rate_per_s": o.rate, "seconds": o.seconds, "warmup_s": o.warmup}
    if mode == "fanout":
        return {
            "messages": o.fanout_messages,
            "subscribers": o.subscribers,
            "publishers": o.publishers,
            "publish_many_batch": o.fanout_batch,
        }
    if mode == "delivery":
        return {
            **base,
            "messages": o.messages,
            "sequences": o.sequences,
            "sequence_members": o.sequence_members,
        }
    return {**base, "messages": o.messages, "x_rows": o.x_rows}
