"""Benchmarks of nmbus against a real PostgreSQL: what ``nmbus bench`` runs.

Every measurement runs in a schema of its own (``nmbus_bench_<random>``) that it
creates and drops, so it never touches the queues of the database it is pointed
at (:mod:`nmbus.bench.scratch`). Each mode is measured by a function of
:mod:`nmbus.bench.scenarios` (the saga's in :mod:`nmbus.bench.saga`); this
module repeats them and gathers the medians, with the settings they ran under.
The modes:

``ceiling``        bare asyncpg loops nmbus is measured against. One-statement:
                   claim up to a batch of ready rows with ``FOR UPDATE SKIP
                   LOCKED`` and mark them X, one autocommitted statement per
                   batch. Crash-safe: nmbus's own two writes (the claim that
                   counts the attempt and takes a lease, then one statement that
                   marks a batch X and claims the next), with no framework.
                   Single-write: a claim that writes each row once (row locks
                   in the batch's transaction, a per-batch record committed on
                   a second connection), with no framework: what a
                   single-write claim could gain at most.
``drain``          pre-load N messages, time a worker draining them with a typed
                   no-op handler, at ``concurrency`` loops and at 2 loops,
                   against both ceilings (the crash-safe one at as many loops).
``transactional``  the same, the handler inserting one row through
                   ``ctx.connection`` (with and without ``outside_effects``);
                   compared with a loop that gives every message its own
                   transaction (claim one, insert, mark X, commit).
``latency``        a producer on its own connections sends at a fixed rate; the
                   time from send to handler start, as percentiles; again with
                   the worker at ``synchronous_commit=off``.
``xrows``          drain on an empty table, then with millions of X rows in the
                   same table, spread over ``segments`` segments, and
                   ``EXPLAIN (ANALYZE, BUFFERS)`` of the claim.
``saga``           drain through a saga that updates its state on every message,
                   against the same handler without a saga; then ``processes``
                   processes of ``concurrency`` loops on ``sagas`` sagas: wall
                   time, deadlocks, messages in F (:mod:`nmbus.bench.saga`).

A mode is a :class:`Mode`: what it measures in one repetition (:class:`Rep`,
which measures the ceilings and the drain once for every mode that compares
with them) and the settings it reports. :func:`run` takes a catalogue of them,
:data:`MODES` unless told otherwise: the repository's ``bench/`` (not shipped)
passes one with its own modes too (peers, fanout, scaling, ...).

Figures are only as good as the machine is quiet: the load average is printed
with the settings of every run.
"""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, TypeVar

import asyncpg

from nmbus.bench.scenarios import (
    explain_claim,
    measure_ceiling,
    measure_drain,
    measure_latency,
    measure_per_message_transactions,
)
from nmbus.bench.scratch import BenchOptions, Scratch
from nmbus.bench.sql import render

__all__ = ["ALL_MODES", "MODES", "BenchOptions", "Mode", "Rep", "Result", "run"]

T = TypeVar("T")
Progress = Callable[[str], None]


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


def _quiet(_: str) -> None:
    pass


async def scratch_run(dsn: str, body: Callable[[Scratch], Awaitable[T]]) -> T:
    """``body`` on a scratch schema of its own, dropped afterwards."""
    async with Scratch(dsn) as scratch:
        return await body(scratch)


class Rep:
    """One repetition of a run: its options, its number, and what its modes share."""

    def __init__(self, options: BenchOptions, number: int, progress: Progress) -> None:
        self.options = options
        self.number = number
        self.progress = progress
        #: The drain mode's rate in this repetition, once it has run (a peer compares with it).
        self.drain: float | None = None
        self._ceilings: tuple[float, float, float] | None = None

    def say(self, what: str) -> None:
        """Tell the progress callback what runs now, in this repetition."""
        self.progress(f"{what}, run {self.number}")

    async def scratch(self, body: Callable[[Scratch], Awaitable[T]]) -> T:
        """``body`` on a scratch schema of its own, dropped afterwards."""
        return await scratch_run(self.options.dsn, body)

    async def ceilings(self) -> tuple[float, float, float]:
        """The one-statement and the crash-safe ceiling, and the crash-safe loop's CPU
        microseconds per message: measured once in a repetition, whoever asks first."""
        if self._ceilings is None:
            self.say("ceiling")
            bare = await self.scratch(partial(measure_ceiling, self.options))
            self.say("crash-safe ceiling")
            cpu: list[float] = []
            safe = await self.scratch(
                partial(measure_ceiling, self.options, safe=True, cpu_used=cpu)
            )
            self._ceilings = (bare, safe, cpu[0])
        return self._ceilings


@dataclass(frozen=True)
class Mode:
    """A mode: what it measures in one repetition, into its Result; the settings it reports."""

    measure: Callable[[Rep, Result], Awaitable[None]]
    settings: Callable[[BenchOptions], dict[str, Any]]


def base_settings(o: BenchOptions) -> dict[str, Any]:
    """The settings every worker-draining mode reports."""
    return {"batch_size": o.batch_size or "adaptive", "concurrency": o.concurrency}


def messages_settings(o: BenchOptions) -> dict[str, Any]:
    return {**base_settings(o), "messages": o.messages}


# -- the modes --------------------------------------------------------------------------


async def _ceiling(rep: Rep, res: Result) -> None:
    ceiling, safe, safe_cpu = await rep.ceilings()
    rep.say("single-write ceiling")
    single = await rep.scratch(partial(measure_ceiling, rep.options, single=True))
    res.add("messages_per_s", ceiling, "msg/s")
    res.add("crash_safe_messages_per_s", safe, "msg/s")
    res.add("crash_safe_ratio", safe / ceiling, "x")
    res.add("crash_safe_cpu_us_per_msg", safe_cpu, "us")
    res.add("single_write_messages_per_s", single, "msg/s")
    res.add("single_write_ratio", single / ceiling, "x")
    res.add("single_write_to_crash_safe", single / safe, "x")


async def _drain(rep: Rep, res: Result) -> None:
    options = rep.options
    ceiling, safe, safe_cpu = await rep.ceilings()
    rep.say("drain")
    cpu: list[float] = []
    drain = await rep.scratch(partial(measure_drain, options, cpu_used=cpu))
    rep.drain = drain
    res.add("messages_per_s", drain, "msg/s")
    res.add("ratio_to_ceiling", drain / ceiling, "x")
    res.add("ratio_to_crash_safe", drain / safe, "x")
    res.add("python_cpu_us_per_msg", cpu[0], "us")
    res.add("framework_cpu_us_per_msg", cpu[0] - safe_cpu, "us")
    rep.say("crash-safe ceiling and drain at 2 loops")
    safe_two = await rep.scratch(partial(measure_ceiling, options, safe=True, loops=2))
    two = await rep.scratch(partial(measure_drain, options, loops=2))
    res.add("two_loops_messages_per_s", two, "msg/s")
    res.add("two_loops_crash_safe_per_s", safe_two, "msg/s")
    res.add("two_loops_ratio_to_crash_safe", two / safe_two, "x")


async def _transactional(rep: Rep, res: Result) -> None:
    options = rep.options
    rep.say("transactional")
    cpu: list[float] = []
    rate = await rep.scratch(partial(measure_drain, options, transactional=True, cpu_used=cpu))
    rep.say("transactional, no outside effects")
    cpu_free: list[float] = []
    free = await rep.scratch(
        partial(
            measure_drain, options, transactional=True, outside_effects=False, cpu_used=cpu_free
        )
    )
    rep.say("per-message transactions")
    base = await rep.scratch(partial(measure_per_message_transactions, options))
    res.add("messages_per_s", rate, "msg/s")
    res.add("no_outside_effects_per_s", free, "msg/s")
    res.add("per_message_tx_per_s", base, "msg/s")
    res.add("ratio_to_per_message_tx", rate / base, "x")
    res.add("ratio_no_outside_effects", free / base, "x")
    res.add("python_cpu_us_per_msg", cpu[0], "us")
    res.add("no_outside_cpu_us_per_msg", cpu_free[0], "us")


def _transactional_settings(o: BenchOptions) -> dict[str, Any]:
    return {**messages_settings(o), "baseline_messages": o.baseline_messages}


async def latency_figures(rep: Rep) -> dict[str, float]:
    """The latency mode's figures of one repetition: the worker as configured, then at
    ``synchronous_commit=off`` (its p50, p99 and after-commit p50)."""
    rep.say("latency")
    figures = await rep.scratch(partial(measure_latency, rep.options))
    rep.say("latency, worker with synchronous_commit=off")
    relaxed = await rep.scratch(partial(measure_latency, rep.options, worker_async_commit=True))
    for name in ("p50_ms", "p99_ms", "after_commit_p50_ms"):
        figures[f"worker_async_{name}"] = relaxed[name]
    return figures


def add_latency(res: Result, figures: Mapping[str, float]) -> None:
    """Latency figures into ``res``: milliseconds, and the sample count."""
    for name, value in figures.items():
        res.add(name, value, "ms" if name.endswith("_ms") else "")


async def _latency(rep: Rep, res: Result) -> None:
    add_latency(res, await latency_figures(rep))


def latency_settings(o: BenchOptions) -> dict[str, Any]:
    return {**base_settings(o), "rate_per_s": o.rate, "seconds": o.seconds, "warmup_s": o.warmup}


async def _xrows(rep: Rep, res: Result) -> None:
    options = rep.options
    rep.say("drain on an empty table")
    empty = await rep.scratch(partial(measure_drain, options))
    rep.say(f"loading {options.x_rows} X rows and draining")

    async def with_x(s: Scratch) -> tuple[float, str]:
        rate = await measure_drain(options, s, x_rows=options.x_rows)
        await s.preload(options.claim_size)
        return rate, await explain_claim(options, s)

    loaded, plan = await rep.scratch(with_x)
    res.add("empty_messages_per_s", empty, "msg/s")
    res.add("with_x_rows_messages_per_s", loaded, "msg/s")
    res.add("ratio_loaded_to_empty", loaded / empty, "x")
    res.notes = [f"EXPLAIN (ANALYZE, BUFFERS) of the claim with {options.x_rows} X rows:"]
    res.notes.append(plan)


def _xrows_settings(o: BenchOptions) -> dict[str, Any]:
    return {**messages_settings(o), "x_rows": o.x_rows, "segments": o.segments}


async def _saga(rep: Rep, res: Result) -> None:
    rep.say("saga and the same handler without")
    # Imported when it runs: the module defines its own saga and message types.
    from nmbus.bench.saga import measure_saga

    for name, value in (await measure_saga(rep.options, Scratch)).items():
        unit = "x" if name.startswith("ratio") else "msg/s"
        if name.endswith("_wall_s"):
            unit = "s"
        elif name in ("contended_deadlocks", "contended_messages_in_f"):
            unit = ""
        res.add(name, value, unit)


def _saga_settings(o: BenchOptions) -> dict[str, Any]:
    from nmbus.bench.saga import SAGAS

    return {
        **messages_settings(o),
        "sagas": SAGAS,
        "contended_processes": o.processes,
        "contended_sagas": o.sagas,
    }


#: nmbus bench's modes, in the order a run measures them.
MODES: dict[str, Mode] = {
    "ceiling": Mode(_ceiling, messages_settings),
    "drain": Mode(_drain, messages_settings),
    "transactional": Mode(_transactional, _transactional_settings),
    "latency": Mode(_latency, latency_settings),
    "xrows": Mode(_xrows, _xrows_settings),
    "saga": Mode(_saga, _saga_settings),
}
#: ``all``: every mode but xrows (millions of rows loaded) and saga (worker processes).
ALL_MODES = ("ceiling", "drain", "transactional", "latency")


# -- the run ----------------------------------------------------------------------------


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


async def run(
    modes: Sequence[str],
    options: BenchOptions,
    progress: Progress = _quiet,
    catalogue: Mapping[str, Mode] = MODES,
) -> list[Result]:
    """Measure ``modes`` (of ``catalogue``) ``options.repeat`` times each; medians in each
    Result's figures. Results come in the order of ``modes``; each repetition measures
    them in the catalogue's order."""
    for mode in modes:
        if mode not in catalogue:
            raise ValueError(f"unknown bench mode {mode!r}; choose from {', '.join(catalogue)}")
    common = {**await _server_settings(options.dsn), **_machine()}
    results = {mode: Result(mode) for mode in modes}
    for number in range(1, options.repeat + 1):
        rep = Rep(options, number, progress)
        for name, measured in catalogue.items():
            if name in results:
                await measured.measure(rep, results[name])
        load = os.getloadavg()[0]
        for result in results.values():
            result.add("load_average_1m", load, "")
    for name, result in results.items():
        settings = catalogue[name].settings(options)
        result.settings = {**settings, **common, "repeat": options.repeat}
    return list(results.values())
