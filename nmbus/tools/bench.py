"""Benchmarks of nmbus against a real PostgreSQL: what ``nmbus bench`` runs.

Every measurement runs in a schema of its own (``nmbus_bench_<random>``) that it
creates and drops, so it never touches the queues of the database it is pointed
at (:mod:`nmbus.tools.bench_scratch`). Each mode is measured by a function of
:mod:`nmbus.tools.bench_scenarios`; this module repeats them and gathers the
medians, with the settings they ran under. The modes:

``ceiling``        bare asyncpg loops nmbus is measured against. One-statement:
                   claim up to a batch of ready rows with ``FOR UPDATE SKIP
                   LOCKED`` and mark them X, one autocommitted statement per
                   batch. Crash-safe: nmbus's own two writes (the claim that
                   counts the attempt and takes a lease, then one statement that
                   marks a batch X and claims the next), with no framework.
                   Single-write: a claim that writes each row once (row locks
                   in the batch's transaction, a per-batch record committed on
                   a second connection), held batches' design (setting
                   held_batches) without the framework.
``peers``          pgqueuer (the ``peers`` extra) draining as many jobs at batch
                   sizes 10 and 100, and graphile-worker (Node.js, installed
                   beforehand: nmbus/tools/bench_graphile.py) at its default
                   and at its performance page's settings, beside an nmbus
                   drain of the same run; ``--peer`` picks one of them. A
                   peer not installed is named in a note, with how to install
                   it; nothing is downloaded.
``drain``          pre-load N messages, time a worker draining them with a typed
                   no-op handler, at ``concurrency`` loops and at 2 loops,
                   against both ceilings (the crash-safe one at as many loops).
``transactional``  the same, the handler inserting one row through
                   ``ctx.connection`` (with and without ``outside_effects``);
                   compared with a loop that gives every message its own
                   transaction (claim one, insert, mark X, commit).
``latency``        a producer on its own connections sends at a fixed rate; the
                   time from send to handler start, as percentiles; again with
                   the worker at ``synchronous_commit=off``, and pgqueuer's.
``scaling``        the drain at 1, 2 and 4 loops and by 2 processes, each against
                   the crash-safe ceiling with as many connections.
``fanout``         publishers call ``Bus.publish``, then ``Bus.publish_many`` in
                   batches, to 3 subscribers; published
                   messages and stored rows per second.
``xrows``          drain on an empty table, then with millions of X rows in the
                   same table, spread over ``segments`` segments, and
                   ``EXPLAIN (ANALYZE, BUFFERS)`` of the claim.
``retention``      ``x_rows`` old X rows in ``segments`` segments removed by the
                   batched DELETE (and its VACUUM), then by dropping segments:
                   time, WAL, dead tuples, size, a claim's worst wait
                   (``bench_retention.py``).
``flow``           flow control: concurrency=5 and rate=200 over 2 worker
                   processes (most and mean running, achieved rate, worst
                   second), the limited claim with 10,000 groups ready, and
                   100,000 messages of one group then 10 of another: how many
                   of the first before the 10 end (``bench_flow.py``).
``saga``           drain through a saga that updates its state on every message,
                   against the same handler without a saga; then ``processes``
                   processes of ``concurrency`` loops on ``sagas`` sagas: wall
                   time, deadlocks, messages in F (``bench_saga.py``).
``burst``          a burst stored while the worker waits on a quiet queue (a new
                   one, and one at rest: its rows processed when last
                   analyzed), against the drain of the same messages
                   pre-loaded and analyzed before it starts (``bench_burst.py``).
``routed``         a send through the outbox and the forwarder to a queue in a
                   second database, against a local send, in one run: p50/p99
                   latency and burst throughput (``bench_routed.py``).
``reply``          request/reply round trips (p50, p99, answered within 3 s) with
                   50 ms handlers, and with 0-4 s handlers 20 at a time
                   (``bench_reply.py``).
``delivery``       in one run: a plain drain, a drain with priorities mixed 0-9,
                   and a drain of ``sequences`` sequences of ``sequence_members``
                   each (interleaved), as rates and ratios to the plain drain
                   (``bench_delivery.py``).

Figures are only as good as the machine is quiet: the load average is printed
with the settings of every run.
"""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import asyncpg

from nmbus.tools import bench_graphile, bench_peers
from nmbus.tools.bench_processes import measure_processes
from nmbus.tools.bench_scenarios import (
    explain_claim,
    measure_ceiling,
    measure_drain,
    measure_fanout,
    measure_latency,
    measure_per_message_transactions,
)
from nmbus.tools.bench_scratch import PEERS, BenchOptions, Scratch
from nmbus.tools.sql import render

__all__ = ["ALL_MODES", "MODES", "PEERS", "BenchOptions", "Result", "run"]

SCALING_LOOPS = (1, 2, 4)
#: The flow mode's units, by how a figure's name ends.
FLOW_UNITS = (("_per_s", "/s"), ("_ms", "ms"), ("_s", "s"))

MODES = (
    "ceiling",
    "peers",
    "drain",
    "transactional",
    "latency",
    "fanout",
    "scaling",
    "xrows",
    "saga",
    "delivery",
    "routed",
    "reply",
    "retention",
    "flow",
    "burst",
)
ALL_MODES = ("ceiling", "peers", "drain", "transactional", "latency", "fanout")


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


async def _scratch_run(dsn: str, body: Callable[[Scratch], Awaitable[Any]]) -> Any:
    async with Scratch(dsn) as scratch:
        return await body(scratch)


async def _measure_peers(
    res: Result, options: BenchOptions, drain: float, rep: int, progress: Progress
) -> None:
    """The peers of ``options.peers`` beside nmbus's drain, each where it is installed."""
    dsn, notes, peers = options.dsn, [], options.peers
    res.add("nmbus_messages_per_s", drain, "msg/s")
    if "pgqueuer" in peers and not bench_peers.available():
        notes.append("pgqueuer is not installed: pip install 'nmbus[peers]'")
    elif "pgqueuer" in peers:
        best = 0.0
        for size in bench_peers.BATCHES:
            progress(f"pgqueuer, batch {size}, run {rep}")
            rate = await _scratch_run(
                dsn, partial(bench_peers.measure_pgqueuer, options, batch_size=size)
            )
            res.add(f"pgqueuer_batch_{size}_per_s", rate, "jobs/s")
            best = max(best, rate)
        res.add("ratio_nmbus_to_best_pgqueuer", drain / best, "x")
    why = bench_graphile.missing()
    if "graphile-worker" in peers and why is not None:
        notes.append(why)
    elif "graphile-worker" in peers:
        rates = {}
        for setting in ("default", "tuned"):
            progress(f"graphile-worker, {setting} settings, run {rep}")
            measure = partial(bench_graphile.measure_graphile, options, mode=setting)
            rates[setting], _ = await _scratch_run(dsn, measure)
            res.add(f"graphile_{setting}_per_s", rates[setting], "jobs/s")
        res.add("ratio_nmbus_to_graphile_tuned", drain / rates["tuned"], "x")
    res.notes = notes


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
    peers = bench_peers.available()  # pgqueuer, for the latency mode
    for rep in range(1, options.repeat + 1):
        ceiling = safe = safe_two = None
        if needs_ceiling:
            progress(f"ceiling, run {rep}")
            ceiling = await _scratch_run(dsn, lambda s: measure_ceiling(options, s))
            progress(f"crash-safe ceiling, run {rep}")
            safe_cpu: list[float] = []
            safe = await _scratch_run(
                dsn, partial(measure_ceiling, options, safe=True, cpu_used=safe_cpu)
            )
            if "ceiling" in results:
                progress(f"single-write ceiling, run {rep}")
                single = await _scratch_run(dsn, partial(measure_ceiling, options, single=True))
                res = results["ceiling"]
                res.add("messages_per_s", ceiling, "msg/s")
                res.add("crash_safe_messages_per_s", safe, "msg/s")
                res.add("crash_safe_ratio", safe / ceiling, "x")
                res.add("crash_safe_cpu_us_per_msg", safe_cpu[0], "us")
                res.add("single_write_messages_per_s", single, "msg/s")
                res.add("single_write_ratio", single / ceiling, "x")
                res.add("single_write_to_crash_safe", single / safe, "x")
        drain = None
        if "drain" in results:
            progress(f"drain, run {rep}")
            cpu: list[float] = []
            drain = await _scratch_run(dsn, partial(measure_drain, options, cpu_used=cpu))
            res = results["drain"]
            assert ceiling is not None and safe is not None
            res.add("messages_per_s", drain, "msg/s")
            res.add("ratio_to_ceiling", drain / ceiling, "x")
            res.add("ratio_to_crash_safe", drain / safe, "x")
            res.add("python_cpu_us_per_msg", cpu[0], "us")
            res.add("framework_cpu_us_per_msg", cpu[0] - safe_cpu[0], "us")
            progress(f"crash-safe ceiling and drain at 2 loops, run {rep}")
            safe_two = await _scratch_run(
                dsn, lambda s: measure_ceiling(options, s, safe=True, loops=2)
            )
            two = await _scratch_run(dsn, partial(measure_drain, options, loops=2))
            res.add("two_loops_messages_per_s", two, "msg/s")
            res.add("two_loops_crash_safe_per_s", safe_two, "msg/s")
            res.add("two_loops_ratio_to_crash_safe", two / safe_two, "x")
        if "peers" in results:
            if drain is None:
                progress(f"nmbus drain for peers, run {rep}")
                drain = await _scratch_run(dsn, partial(measure_drain, options))
            await _measure_peers(results["peers"], options, drain, rep, progress)
        if "transactional" in results:
            progress(f"transactional, run {rep}")
            cpu = []
            run_tx = partial(measure_drain, options, transactional=True, cpu_used=cpu)
            rate = await _scratch_run(dsn, run_tx)
            progress(f"transactional, no outside effects, run {rep}")
            cpu_free: list[float] = []
            run_free = partial(
                measure_drain, options, transactional=True, outside_effects=False, cpu_used=cpu_free
            )
            free = await _scratch_run(dsn, run_free)
            progress(f"per-message transactions, run {rep}")
            base = await _scratch_run(dsn, lambda s: measure_per_message_transactions(options, s))
            res = results["transactional"]
            res.add("messages_per_s", rate, "msg/s")
            res.add("no_outside_effects_per_s", free, "msg/s")
            res.add("per_message_tx_per_s", base, "msg/s")
            res.add("ratio_to_per_message_tx", rate / base, "x")
            res.add("ratio_no_outside_effects", free / base, "x")
            res.add("python_cpu_us_per_msg", cpu[0], "us")
            res.add("no_outside_cpu_us_per_msg", cpu_free[0], "us")
        if "scaling" in results:
            res = results["scaling"]
            for loops in SCALING_LOOPS:
                progress(f"scaling: crash-safe ceiling and drain at {loops} loops, run {rep}")
                top = await _scratch_run(
                    dsn, partial(measure_ceiling, options, safe=True, loops=loops)
                )
                rate = await _scratch_run(dsn, partial(measure_drain, options, loops=loops))
                res.add(f"crash_safe_{loops}_loops_per_s", top, "msg/s")
                res.add(f"drain_{loops}_loops_per_s", rate, "msg/s")
                res.add(f"ratio_{loops}_loops", rate / top, "x")
                if loops == 2:
                    two_safe = top
            progress(f"scaling: drain by 2 processes, run {rep}")
            rate = await _scratch_run(dsn, partial(measure_processes, options, processes=2))
            res.add("drain_2_processes_per_s", rate, "msg/s")
            res.add("ratio_2_processes", rate / two_safe, "x")
        if "latency" in results:
            progress(f"latency, run {rep}")
            figures = await _scratch_run(dsn, lambda s: measure_latency(options, s))
            progress(f"latency, worker with synchronous_commit=off, run {rep}")
            relaxed = await _scratch_run(
                dsn, partial(measure_latency, options, worker_async_commit=True)
            )
            for name in ("p50_ms", "p99_ms", "after_commit_p50_ms"):
                figures[f"worker_async_{name}"] = relaxed[name]
            if peers:
                progress(f"pgqueuer latency, run {rep}")
                theirs = await _scratch_run(
                    dsn, partial(bench_peers.measure_pgqueuer_latency, options)
                )
                figures.update({f"pgqueuer_{k}": v for k, v in theirs.items()})
                figures["p99_ratio_to_pgqueuer"] = figures["p99_ms"] / theirs["p99_ms"]
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
        if "xrows" in results:
            progress(f"drain on an empty table, run {rep}")
            empty = await _scratch_run(dsn, lambda s: measure_drain(options, s))
            progress(f"loading {options.x_rows} X rows and draining, run {rep}")

            async def with_x(s: Scratch) -> tuple[float, str]:
                rate = await measure_drain(options, s, x_rows=options.x_rows)
                await s.preload(options.claim_size)
                return rate, await explain_claim(options, s)

            loaded, plan = await _scratch_run(dsn, with_x)
            res = results["xrows"]
            res.add("empty_messages_per_s", empty, "msg/s")
            res.add("with_x_rows_messages_per_s", loaded, "msg/s")
            res.add("ratio_loaded_to_empty", loaded / empty, "x")
            res.notes = [f"EXPLAIN (ANALYZE, BUFFERS) of the claim with {options.x_rows} X rows:"]
            res.notes.append(plan)
        if "flow" in results:
            progress(f"flow: concurrency, rate and groups, run {rep}")
            from nmbus.tools.bench_flow import measure_fairness, measure_flow

            figures = await _scratch_run(dsn, lambda s: measure_flow(options, s))
            figures.update(await _scratch_run(dsn, lambda s: measure_fairness(options, s)))
            for name, value in figures.items():
                unit = next((u for end, u in FLOW_UNITS if name.endswith(end)), "")
                results["flow"].add(name, value, unit)
        if "retention" in results:
            from nmbus.tools.bench_retention import measure_retention

            figures = await measure_retention(
                options, lambda body: _scratch_run(dsn, body), progress
            )
            units = (("_seconds", "s"), ("_mb", "MiB"), ("_ms", "ms"))
            for name, value in figures.items():
                unit = next((u for end, u in units if name.endswith(end)), "")
                results["retention"].add(name, value, unit)
        if "delivery" in results:
            from nmbus.tools.bench_delivery import measure_delivery

            figures = await measure_delivery(options, _scratch_run, progress)
            for name, value in figures.items():
                unit = "x" if "ratio" in name else "msg/s"
                results["delivery"].add(name, value, unit)
        if "routed" in results:
            from nmbus.tools.bench_routed import measure_routed

            for name, value in (await measure_routed(options, progress)).items():
                unit = "ms" if name.endswith("_ms") else "x" if "ratio" in name else "msg/s"
                results["routed"].add(name, value, "" if name == "burst_messages" else unit)
        if "saga" in results:
            progress(f"saga and the same handler without, run {rep}")
            from nmbus.tools.bench_saga import measure_saga

            for name, value in (await measure_saga(options, Scratch)).items():
                unit = "x" if name.startswith("ratio") else "msg/s"
                if name.endswith("_wall_s"):
                    unit = "s"
                elif name in ("contended_deadlocks", "contended_messages_in_f"):
                    unit = ""
                results["saga"].add(name, value, unit)
        if "burst" in results:
            progress(f"a burst into a quiet queue, run {rep}")
            from nmbus.tools.bench_burst import measure_burst

            for name, value in (await measure_burst(options)).items():
                results["burst"].add(name, value, "x" if name.startswith("ratio") else "msg/s")
        if "reply" in results:
            progress(f"request/reply round trips, run {rep}")
            from nmbus.tools.bench_reply import measure_reply

            for name, value in (await measure_reply(options, Scratch)).items():
                results["reply"].add(name, value, "ms" if name.endswith("_ms") else "")
        load = os.getloadavg()[0]
        for result in results.values():
            result.add("load_average_1m", load, "")
    for mode, result in results.items():
        result.settings = {**_mode_settings(mode, options), **common, "repeat": options.repeat}
    return list(results.values())


def _mode_settings(mode: str, o: BenchOptions) -> dict[str, Any]:
    base = {
        "batch_size": o.batch_size or "adaptive",
        "concurrency": o.concurrency,
    }
    if mode in ("ceiling", "drain", "scaling"):
        return {**base, "messages": o.messages}
    if mode == "flow":
        from nmbus.tools import bench_flow as f

        return {
            "processes": f.PROCESSES,
            "loops": f.LOOPS,
            "handler_concurrency": f.AT_ONCE,
            "concurrency": f.CONCURRENCY,
            "rate": f.RATE,
            "groups": f.GROUPS,
        }
    if mode == "peers":
        found = bench_peers.version() if bench_peers.available() else "not installed"
        graphile = "not installed" if bench_graphile.missing() else bench_graphile.version()
        if "pgqueuer" not in o.peers:
            found = "not asked for"
        if "graphile-worker" not in o.peers:
            graphile = "not asked for"
        return {
            **base,
            "messages": o.messages,
            "pgqueuer": found,
            "graphile_worker": graphile,
            "graphile_default_jobs": min(o.messages, bench_graphile.DEFAULT_MODE_JOBS),
        }
    if mode == "transactional":
        return {**base, "messages": o.messages, "baseline_messages": o.baseline_messages}
    if mode == "latency":
        return {**base, "rate_per_s": o.rate, "seconds": o.seconds, "warmup_s": o.warmup}
    if mode == "delivery":
        return {
            **base,
            "messages": o.messages,
            "sequences": o.sequences,
            "sequence_members": o.sequence_members,
        }
    if mode == "routed":
        return {**base, "rate_per_s": o.rate, "seconds": o.seconds, "warmup_s": o.warmup}
    if mode == "saga":
        from nmbus.tools.bench_saga import SAGAS

        return {
            **base,
            "messages": o.messages,
            "sagas": SAGAS,
            "contended_processes": o.processes,
            "contended_sagas": o.sagas,
        }
    if mode == "burst":
        from nmbus.tools.bench_burst import REST_ROWS

        return {**base, "messages": o.messages, "rest_rows": REST_ROWS}
    if mode == "reply":
        from nmbus.tools.bench_reply import HANDLER_CONCURRENCY, IN_TIME

        return {**base, "in_time_s": IN_TIME, "handler_concurrency": HANDLER_CONCURRENCY}
    if mode == "fanout":
        return {
            "messages": o.fanout_messages,
            "subscribers": o.subscribers,
            "publishers": o.publishers,
            "publish_many_batch": o.fanout_batch,
        }
    return {**base, "messages": o.messages, "x_rows": o.x_rows, "segments": o.segments}
