"""``python -m bench.connections``: the connections of one process that hosts endpoints.

It creates a database of its own (``nmbus_bench_<random>``, dropped at the
end), so that every connection to that database but its sampler's is the
process's. Then:

1. a send-only Bus stores ``messages`` messages for each of ``endpoints``
   endpoints, and stops;
2. the endpoints start, each a Bus with a no-op handler and the settings of
   the environment (``NMBUS_*``: the defaults unless told), and drain their
   backlog: the rate is every endpoint's messages over the time from the
   first start to the last message handled;
3. while they run, ``senders`` tasks per endpoint each send ``sends``
   messages to it at once, so that the send pools grow as far as they go;
4. every Bus stops.

Throughout, a connection of its own counts the database's other backends
every 10 ms (``pg_stat_activity``): the most at once in each phase, with
their ``application_name`` at that moment, and what is left after the stop.

It imports nmbus alone, so ``python bench/connections.py`` from outside a
checkout measures whichever nmbus ``PYTHONPATH`` names (a version before a
change, say); ``--json`` prints the figures as one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
import uuid
from collections import Counter
from contextlib import suppress
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import structlog

from nmbus import Bus, Context, Message
from nmbus.bench.scenarios import wait_until

#: Seconds between two counts of the database's connections.
SAMPLE_EVERY = 0.01
#: Sends stored in one transaction while the backlog is loaded.
LOAD_CHUNK = 500


class Tick(Message, type_name="bench.connections.Tick"):
    n: int


def _with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


class Sampler:
    """Counts the database's backends but its own, by application_name, until stopped."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        self.phase = "start"
        #: The most backends seen at once in each phase, and who they were then.
        self.peaks: dict[str, tuple[int, Counter[str]]] = {}
        self._task: asyncio.Task[None] | None = None

    async def count(self) -> Counter[str]:
        rows = await self.conn.fetch(
            "SELECT application_name FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND backend_type = 'client backend'"
        )
        return Counter(r[0] or "(none)" for r in rows)

    async def _run(self) -> None:
        while True:
            seen = await self.count()
            total = sum(seen.values())
            peak = self.peaks.get(self.phase)
            if peak is None or total > peak[0]:
                self.peaks[self.phase] = (total, seen)
            await asyncio.sleep(SAMPLE_EVERY)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def _load(dsn: str, queues: list[str], messages: int) -> None:
    loader = Bus("bench_loader", dsn=dsn, concurrency=0)
    async with loader, loader.store.pool.acquire() as conn:  # type: ignore[attr-defined]
        for queue in queues:
            for start in range(0, messages, LOAD_CHUNK):
                async with conn.transaction():
                    for n in range(start, min(messages, start + LOAD_CHUNK)):
                        await loader.send(Tick(n=n), to=queue, connection=conn)


def _endpoint(dsn: str, queue: str, handled: Counter[str]) -> Bus:
    bus = Bus(queue, dsn=dsn)

    @bus.handler
    async def handle(msg: Tick, ctx: Context) -> None:
        handled[queue] += 1

    return bus


async def _until_none_left(sampler: Sampler, timeout: float) -> None:
    # A backend whose client closed ends a moment later, and says so to no one.
    async with asyncio.timeout(timeout):
        while sum((await sampler.count()).values()):  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def measure(
    dsn: str, endpoints: int, messages: int, senders: int, sends: int
) -> dict[str, Any]:
    queues = [f"bench_endpoint_{i}" for i in range(endpoints)]
    handled: Counter[str] = Counter()
    buses = [_endpoint(dsn, queue, handled) for queue in queues]
    await _load(dsn, queues, messages)
    sampler = Sampler(await asyncpg.connect(dsn))
    figures: dict[str, Any] = {"endpoints": endpoints, "messages": messages * endpoints}
    try:
        await _until_none_left(sampler, 30)  # the loader's
        sampler.start()
        sampler.phase = "drain"
        began = time.perf_counter()
        for bus in buses:
            await bus.start()
        try:
            total = messages * endpoints
            await wait_until(lambda: sum(handled.values()) >= total, 600)
            elapsed = time.perf_counter() - began
            figures["drain_seconds"] = round(elapsed, 3)
            figures["drain_messages_per_s"] = round(total / elapsed)
            sampler.phase = "send"

            async def send(bus: Bus) -> None:
                for n in range(sends):
                    await bus.send(Tick(n=n), to=bus.endpoint)

            await asyncio.gather(*(send(bus) for bus in buses for _ in range(senders)))
            total += endpoints * senders * sends
            await wait_until(lambda: sum(handled.values()) >= total, 600)
        finally:
            for bus in buses:
                await bus.stop()
        sampler.phase = "stopped"
        await sampler.stop()
        with suppress(TimeoutError):
            await _until_none_left(sampler, 5)
        figures["left_after_stop"] = sum((await sampler.count()).values())
    finally:
        await sampler.stop()
        await sampler.conn.close()
    for phase in ("drain", "send"):
        most, who = sampler.peaks.get(phase, (0, Counter()))
        figures[f"{phase}_peak_connections"] = most
        figures[f"{phase}_peak_by_application_name"] = dict(sorted(who.items()))
    return figures


async def run(args: argparse.Namespace) -> dict[str, Any]:
    database = f"nmbus_bench_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(args.dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{database}"')
        try:
            return await measure(
                _with_database(args.dsn, database),
                args.endpoints,
                args.messages,
                args.senders,
                args.sends,
            )
        finally:
            await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    finally:
        await admin.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.connections", description=__doc__)
    parser.add_argument("--dsn", default=os.environ.get("NMBUS_DSN"), help="default: NMBUS_DSN")
    parser.add_argument("--endpoints", type=int, default=3, help="Buses in the process")
    parser.add_argument("-n", "--messages", type=int, default=10_000, help="per endpoint")
    parser.add_argument("--senders", type=int, default=8, help="send tasks per endpoint")
    parser.add_argument("--sends", type=int, default=100, help="messages per send task")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    if not args.dsn:
        parser.error("no database: pass --dsn or set NMBUS_DSN")
    # nmbus's warnings only: its info lines would bury the figures.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    figures = asyncio.run(run(args))
    if args.json:
        print(json.dumps(figures))
        return
    for key, value in figures.items():
        print(f"{key:36} {value}")


if __name__ == "__main__":
    main()
