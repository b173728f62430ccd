"""The modes of ``python -m bench``: nmbus bench's six, and ten of the repository's own.

nmbus's runner (:mod:`nmbus.bench.runner`) measures them: :func:`run` gives it
the catalogue :data:`MODES`, nmbus bench's modes with these, in the order a
repetition measures them. Its latency mode adds pgqueuer's latency when
pgqueuer is installed. The modes of this repository's own:

``peers``      pgqueuer (the ``peers`` extra) draining as many jobs at batch
               sizes 10 and 100, and graphile-worker (Node.js, installed
               beforehand: :mod:`bench.graphile`) at its default and at its
               performance page's settings, beside an nmbus drain of the same
               run; ``--peer`` picks one of them. A peer not installed is named
               in a note, with how to install it; nothing is downloaded.
``fanout``     publishers call ``Bus.publish``, then ``Bus.publish_many`` in
               batches, to 3 subscribers; published messages and stored rows
               per second (:mod:`bench.fanout`).
``scaling``    the drain at 1, 2 and 4 loops and by 2 processes, each against
               the crash-safe ceiling with as many connections
               (:mod:`bench.processes`).
``retention``  ``x_rows`` old X rows in ``segments`` segments removed by the
               batched DELETE (and its VACUUM), then by dropping segments:
               time, WAL, dead tuples, size, a claim's worst wait
               (:mod:`bench.retention`).
``flow``       flow control: concurrency=5 and rate=200 over 2 worker
               processes (most and mean running, achieved rate, worst
               second), the limited claim with 10,000 groups ready, and
               100,000 messages of one group then 10 of another: how many of
               the first before the 10 end (:mod:`bench.flow`).
``burst``      a burst stored while the worker waits on a quiet queue (a new
               one, and one at rest: its rows processed when last analyzed),
               against the drain of the same messages pre-loaded and analyzed
               before it starts (:mod:`bench.burst`).
``routed``     a send through the outbox and the forwarder to a queue in a
               second database, against a local send, in one run: p50/p99
               latency and burst throughput (:mod:`bench.routed`).
``reply``      request/reply round trips (p50, p99, answered within 3 s) with
               50 ms handlers, and with 0-4 s handlers 20 at a time
               (:mod:`bench.reply`).
``pooler``     in one run, nmbus straight to PostgreSQL and behind a PgBouncer
               in transaction mode that the bench starts (the machine's
               pgbouncer): the drain, and the latency p50/p99 direct, through
               the pooler with ``listen_dsn`` and through it polling
               (:mod:`bench.pooler`).
``delivery``   in one run: a plain drain, a drain with priorities mixed 0-9,
               and a drain of ``sequences`` sequences of ``sequence_members``
               each (interleaved), as rates and ratios to the plain drain
               (:mod:`bench.delivery`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from bench import graphile, peers
from bench.fanout import measure_fanout
from bench.options import PEERS, Options
from bench.processes import measure_processes
from nmbus.bench import runner
from nmbus.bench.runner import (
    Mode,
    Progress,
    Rep,
    Result,
    add_latency,
    base_settings,
    latency_figures,
    latency_settings,
    messages_settings,
)
from nmbus.bench.scenarios import measure_ceiling, measure_drain
from nmbus.bench.scratch import BenchOptions, Scratch

__all__ = ["ALL_MODES", "MODES", "PEERS", "Options", "Result", "run"]

SCALING_LOOPS = (1, 2, 4)
#: The flow mode's units, by how a figure's name ends.
FLOW_UNITS = (("_per_s", "/s"), ("_ms", "ms"), ("_s", "s"))


def _options(rep: Rep) -> Options:
    assert isinstance(rep.options, Options), "bench's modes take bench.options.Options"
    return rep.options


def _quiet(_: str) -> None:
    pass


# -- peers ------------------------------------------------------------------------------


async def _peers(rep: Rep, res: Result) -> None:
    """The peers of ``options.peers`` beside nmbus's drain, each where it is installed."""
    options = _options(rep)
    drain = rep.drain
    if drain is None:
        rep.say("nmbus drain for peers")
        drain = await rep.scratch(partial(measure_drain, options))
    notes, asked = [], options.peers
    res.add("nmbus_messages_per_s", drain, "msg/s")
    if "pgqueuer" in asked and not peers.available():
        notes.append("pgqueuer is not installed: pip install 'nmbus[peers]'")
    elif "pgqueuer" in asked:
        best = 0.0
        for size in peers.BATCHES:
            rep.say(f"pgqueuer, batch {size}")
            rate = await rep.scratch(partial(peers.measure_pgqueuer, options, batch_size=size))
            res.add(f"pgqueuer_batch_{size}_per_s", rate, "jobs/s")
            best = max(best, rate)
        res.add("ratio_nmbus_to_best_pgqueuer", drain / best, "x")
    why = graphile.missing()
    if "graphile-worker" in asked and why is not None:
        notes.append(why)
    elif "graphile-worker" in asked:
        rates = {}
        for setting in ("default", "tuned"):
            rep.say(f"graphile-worker, {setting} settings")
            measure = partial(graphile.measure_graphile, options, mode=setting)
            rates[setting], _ = await rep.scratch(measure)
            res.add(f"graphile_{setting}_per_s", rates[setting], "jobs/s")
        res.add("ratio_nmbus_to_graphile_tuned", drain / rates["tuned"], "x")
    res.notes = notes


def _peers_settings(o: BenchOptions) -> dict[str, Any]:
    assert isinstance(o, Options)
    found = peers.version() if peers.available() else "not installed"
    node = "not installed" if graphile.missing() else graphile.version()
    if "pgqueuer" not in o.peers:
        found = "not asked for"
    if "graphile-worker" not in o.peers:
        node = "not asked for"
    return {
        **messages_settings(o),
        "pgqueuer": found,
        "graphile_worker": node,
        "graphile_default_jobs": min(o.messages, graphile.DEFAULT_MODE_JOBS),
    }


async def _latency(rep: Rep, res: Result) -> None:
    """nmbus bench's latency, and pgqueuer's beside it where it is installed."""
    figures = await latency_figures(rep)
    if peers.available():
        rep.say("pgqueuer latency")
        theirs = await rep.scratch(partial(peers.measure_pgqueuer_latency, rep.options))
        figures.update({f"pgqueuer_{k}": v for k, v in theirs.items()})
        figures["p99_ratio_to_pgqueuer"] = figures["p99_ms"] / theirs["p99_ms"]
    add_latency(res, figures)


# -- fanout and scaling -----------------------------------------------------------------


async def _fanout(rep: Rep, res: Result) -> None:
    rep.say("fanout")
    figures = await rep.scratch(partial(measure_fanout, _options(rep)))
    res.add("published_per_s", figures["published_per_s"], "msg/s")
    res.add("rows_per_s", figures["rows_per_s"], "rows/s")
    res.add("batched_published_per_s", figures["batched_published_per_s"], "msg/s")
    res.add("batched_rows_per_s", figures["batched_rows_per_s"], "rows/s")


def _fanout_settings(o: BenchOptions) -> dict[str, Any]:
    assert isinstance(o, Options)
    return {
        "messages": o.fanout_messages,
        "subscribers": o.subscribers,
        "publishers": o.publishers,
        "publish_many_batch": o.fanout_batch,
    }


async def _scaling(rep: Rep, res: Result) -> None:
    options = rep.options
    two_safe = 0.0
    for loops in SCALING_LOOPS:
        rep.say(f"scaling: crash-safe ceiling and drain at {loops} loops")
        top = await rep.scratch(partial(measure_ceiling, options, safe=True, loops=loops))
        rate = await rep.scratch(partial(measure_drain, options, loops=loops))
        res.add(f"crash_safe_{loops}_loops_per_s", top, "msg/s")
        res.add(f"drain_{loops}_loops_per_s", rate, "msg/s")
        res.add(f"ratio_{loops}_loops", rate / top, "x")
        if loops == 2:
            two_safe = top
    rep.say("scaling: drain by 2 processes")
    rate = await rep.scratch(partial(measure_processes, options, processes=2))
    res.add("drain_2_processes_per_s", rate, "msg/s")
    res.add("ratio_2_processes", rate / two_safe, "x")


# -- flow, retention, delivery, routed, burst, reply ------------------------------------


async def _flow(rep: Rep, res: Result) -> None:
    from bench.flow import measure_fairness, measure_flow

    rep.say("flow: concurrency, rate and groups")
    figures = await rep.scratch(partial(measure_flow, rep.options))
    figures.update(await rep.scratch(partial(measure_fairness, rep.options)))
    for name, value in figures.items():
        unit = next((u for end, u in FLOW_UNITS if name.endswith(end)), "")
        res.add(name, value, unit)


def _flow_settings(o: BenchOptions) -> dict[str, Any]:
    from bench import flow as f

    return {
        "processes": f.PROCESSES,
        "loops": f.LOOPS,
        "handler_concurrency": f.AT_ONCE,
        "concurrency": f.CONCURRENCY,
        "rate": f.RATE,
        "groups": f.GROUPS,
    }


async def _retention(rep: Rep, res: Result) -> None:
    from bench.retention import measure_retention

    figures = await measure_retention(rep.options, rep.scratch, rep.progress)
    units = (("_seconds", "s"), ("_mb", "MiB"), ("_ms", "ms"))
    for name, value in figures.items():
        unit = next((u for end, u in units if name.endswith(end)), "")
        res.add(name, value, unit)


def _retention_settings(o: BenchOptions) -> dict[str, Any]:
    return {**messages_settings(o), "x_rows": o.x_rows, "segments": o.segments}


async def _delivery(rep: Rep, res: Result) -> None:
    from bench.delivery import measure_delivery

    figures = await measure_delivery(_options(rep), runner.scratch_run, rep.progress)
    for name, value in figures.items():
        res.add(name, value, "x" if "ratio" in name else "msg/s")


def _delivery_settings(o: BenchOptions) -> dict[str, Any]:
    assert isinstance(o, Options)
    return {
        **messages_settings(o),
        "sequences": o.sequences,
        "sequence_members": o.sequence_members,
    }


async def _routed(rep: Rep, res: Result) -> None:
    from bench.routed import measure_routed

    for name, value in (await measure_routed(rep.options, rep.progress)).items():
        unit = "ms" if name.endswith("_ms") else "x" if "ratio" in name else "msg/s"
        res.add(name, value, "" if name == "burst_messages" else unit)


async def _pooler(rep: Rep, res: Result) -> None:
    from bench.pooler import measure_pooler

    for name, value in (await measure_pooler(_options(rep), rep.progress)).items():
        unit = "ms" if name.endswith("_ms") else "x" if "ratio" in name else "msg/s"
        res.add(name, value, "" if name == "pooler_transactions" else unit)


def _pooler_settings(o: BenchOptions) -> dict[str, Any]:
    from bench.pooler import POLL, POOL_SIZE

    return {
        **messages_settings(o),
        **latency_settings(o),
        "pgbouncer_pool_size": POOL_SIZE,
        "poll_behind_pooler_s": POLL,
    }


async def _burst(rep: Rep, res: Result) -> None:
    from bench.burst import measure_burst

    rep.say("a burst into a quiet queue")
    for name, value in (await measure_burst(rep.options)).items():
        res.add(name, value, "x" if name.startswith("ratio") else "msg/s")


def _burst_settings(o: BenchOptions) -> dict[str, Any]:
    from bench.burst import REST_ROWS

    return {**messages_settings(o), "rest_rows": REST_ROWS}


async def _reply(rep: Rep, res: Result) -> None:
    from bench.reply import measure_reply

    rep.say("request/reply round trips")
    for name, value in (await measure_reply(rep.options, Scratch)).items():
        res.add(name, value, "ms" if name.endswith("_ms") else "")


def _reply_settings(o: BenchOptions) -> dict[str, Any]:
    from bench.reply import HANDLER_CONCURRENCY, IN_TIME

    return {**base_settings(o), "in_time_s": IN_TIME, "handler_concurrency": HANDLER_CONCURRENCY}


# -- the catalogue ----------------------------------------------------------------------

_OWN: dict[str, Mode] = {
    "peers": Mode(_peers, _peers_settings),
    "scaling": Mode(_scaling, messages_settings),
    "latency": replace(runner.MODES["latency"], measure=_latency),
    "fanout": Mode(_fanout, _fanout_settings),
    "flow": Mode(_flow, _flow_settings),
    "retention": Mode(_retention, _retention_settings),
    "delivery": Mode(_delivery, _delivery_settings),
    "routed": Mode(_routed, latency_settings),
    "pooler": Mode(_pooler, _pooler_settings),
    "burst": Mode(_burst, _burst_settings),
    "reply": Mode(_reply, _reply_settings),
}
_ORDER = (
    "ceiling",
    "drain",
    "peers",
    "transactional",
    "scaling",
    "latency",
    "fanout",
    "xrows",
    "flow",
    "retention",
    "delivery",
    "routed",
    "pooler",
    "saga",
    "burst",
    "reply",
)
#: Every mode, in the order a repetition measures them.
MODES: dict[str, Mode] = {name: _OWN.get(name) or runner.MODES[name] for name in _ORDER}
#: ``all``: nmbus bench's quick four with the peers and fanout.
ALL_MODES = ("ceiling", "peers", "drain", "transactional", "latency", "fanout")


async def run(modes: Sequence[str], options: Options, progress: Progress = _quiet) -> list[Result]:
    """Measure ``modes`` (of :data:`MODES`) as nmbus bench does: medians of ``options.repeat``."""
    return await runner.run(modes, options, progress, MODES)
