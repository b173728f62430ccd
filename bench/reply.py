"""``python -m bench reply``: request/reply round trips when handlers take time.

Kept apart from :mod:`nmbus.bench.runner` (which calls :func:`measure_reply` for
the ``reply`` mode). A requesting endpoint fires its requests all at once at a
replying endpoint whose handler sleeps, then answers with ``ctx.reply``. The
replying worker starts once every request is stored, so its first claim takes
a whole batch (as it does for requests that arrive while it is busy); each
round trip is timed from the call of ``bus.request`` to its return. Requests
wait long enough for every answer (``WAIT`` seconds), so the percentiles are
real; ``answered_in_time`` counts the round trips of at most ``IN_TIME``
seconds, as many as a caller with a 3 s timeout would have seen answered.
``reply_lag`` is the part of a round trip that is the bus's own: from the
handler's ``ctx.reply`` to the requester's return, without the time the
request waited for its turn or its handler took. Two scenarios:

``slow_50ms``   ``REQUESTS_50MS`` requests, each handled in 50 ms, at the given
                batch size and one handler at a time.
``concurrent``  ``REQUESTS_CONCURRENT`` requests handled in 0-``LONGEST`` s each
                (a fixed pseudo-random spread), ``handler_concurrency=20``.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid

from bench.sql import render
from nmbus.bench.scenarios import percentile
from nmbus.bench.scratch import BenchOptions, Scratch
from nmbus.bus import Bus
from nmbus.context import Context
from nmbus.messages import Message

IN_TIME = 3.0
WAIT = 120.0
REQUESTS_50MS = 100
REQUESTS_CONCURRENT = 300
LONGEST = 4.0
HANDLER_CONCURRENCY = 20


class Ask(Message, type_name="nmbus.bench.Ask"):
    """A request whose handler sleeps ``seconds`` before it answers."""

    n: int
    seconds: float


class Answer(Message, type_name="nmbus.bench.Answer"):
    n: int


async def _round_trips(
    options: BenchOptions, scratch: Scratch, waits: list[float], **settings: object
) -> tuple[list[float], list[float]]:
    """Each request's round trip, and its reply's lag (both seconds)."""
    # Endpoint names of their own: the scratch schema is fresh, but a name says what it is.
    replier_name = f"bench_replier_{uuid.uuid4().hex[:6]}"
    replier = Bus(replier_name, settings=options.bus_settings(scratch.schema, **settings))
    requester = Bus("bench_requester", settings=options.bus_settings(scratch.schema))
    async with Bus(replier_name, settings=options.bus_settings(scratch.schema, concurrency=0)):
        pass  # its queue, where the requests wait

    replied: dict[int, float] = {}
    lags: list[float] = []

    @replier.handler
    async def answer(msg: Ask, ctx: Context) -> None:
        await asyncio.sleep(msg.seconds)
        replied[msg.n] = time.perf_counter()
        await ctx.reply(Answer(n=msg.n))

    async def one(n: int) -> float:
        started = time.perf_counter()
        reply = await requester.request(Ask(n=n, seconds=waits[n]), to=replier_name, timeout=WAIT)
        if not isinstance(reply, Answer) or reply.n != n:
            raise RuntimeError(f"request {n} got the wrong answer: {reply!r}")
        now = time.perf_counter()
        lags.append(now - replied[n])
        return now - started

    async with requester:
        asking = [asyncio.create_task(one(n)) for n in range(len(waits))]
        stored = render("bench_count_subqueue", scratch.schema, replier_name)
        async with asyncio.timeout(WAIT):
            while await scratch.c.fetchval(stored, "I") < len(waits):  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        async with replier:
            return list(await asyncio.gather(*asking)), lags


def _figures(prefix: str, trips: list[float], lags: list[float]) -> dict[str, float]:
    return {
        f"{prefix}_p50_ms": percentile(trips, 50) * 1000,
        f"{prefix}_p99_ms": percentile(trips, 99) * 1000,
        f"{prefix}_reply_lag_p50_ms": percentile(lags, 50) * 1000,
        f"{prefix}_reply_lag_p99_ms": percentile(lags, 99) * 1000,
        f"{prefix}_answered_in_time": float(sum(1 for t in trips if t <= IN_TIME)),
        f"{prefix}_requests": float(len(trips)),
    }


async def measure_reply(options: BenchOptions, fresh: type[Scratch]) -> dict[str, float]:
    """Both scenarios, each in a scratch schema of its own."""
    figures: dict[str, float] = {}
    async with fresh(options.dsn) as scratch:
        trips, lags = await _round_trips(options, scratch, [0.05] * REQUESTS_50MS)
        figures.update(_figures("slow_50ms", trips, lags))
    spread = random.Random(23)
    waits = [spread.uniform(0.0, LONGEST) for _ in range(REQUESTS_CONCURRENT)]
    async with fresh(options.dsn) as scratch:
        trips, lags = await _round_trips(
            options, scratch, waits, handler_concurrency=HANDLER_CONCURRENCY
        )
        figures.update(_figures("concurrent", trips, lags))
    return figures
