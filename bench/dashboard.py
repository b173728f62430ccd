"""How long a dashboard refresh takes on a queue of millions of processed rows.

``python -m bench.dashboard --dsn ... [--rows 4000000]`` fills a
queue ``orders`` in a schema of its own (``nmbus_dashbench``, kept between
runs so a second run skips the fill; ``--fresh`` refills it) with ``--rows``
X rows spread over seven days, 2 000 I, 200 R and 600 F rows, then times,
each as the median of ``--repeat`` runs:

- what one refresh of the queues page reads (``queue_status`` with the 5 and
  60 minute windows, and the 12-bucket history of each queue), the queue
  page (``queue_detail`` and its 60-bucket history), a page of failed
  messages filtered by error text, and a ``/metrics`` scrape;
- against the ceiling it replaces, measured in the same run: the full pass
  over the table (``queue_status(exact=True)``, what ``nmbus status`` did
  before schema version 7) and a plain ``SELECT count(*)`` of the table.

It prints the figures, their ratios to the ceilings, and the load average.

``--queues N`` measures instead the dashboard of a schema of many small queues
(``nmbus_dashbench_many``: N queues of 20 X rows over the last hour, a few I
rows each, 3 F rows in every tenth): the queues page ``/``, its refreshed
fragment and ``/metrics``, each answered by the dashboard's own application
(in this process, no HTTP server), with their size and, for ``/metrics``, the
number of series.

``--index-cost`` measures instead what the done index costs the hot path: a
worker draining ``--messages`` pre-loaded messages on a queue with the index
and on one without it (as before schema version 7), alternated ``--repeat``
times in scratch schemas of their own; the medians and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import structlog

from bench.sql import render
from nmbus.bench.scenarios import measure_drain
from nmbus.bench.scratch import QUEUE as BENCH_QUEUE
from nmbus.bench.scratch import BenchOptions, Scratch
from nmbus.dashboard.app import overview
from nmbus.dashboard.metrics import exposition
from nmbus.ops.admin import Admin
from nmbus.postgres.schema import install_schema
from nmbus.postgres.sql import render as render_runtime

SCHEMA = "nmbus_dashbench"
QUEUE = "orders"
MANY_SCHEMA = "nmbus_dashbench_many"


async def seed(dsn: str, rows: int, fresh: bool) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        await install_schema(conn, SCHEMA)
        exists = await conn.fetchval(render_runtime("queue_exists", SCHEMA), SCHEMA, QUEUE)
        if exists and not fresh:
            return int(await conn.fetchval(render("bench_count_all", SCHEMA, QUEUE)))
        if exists:
            await conn.execute(render_runtime("drop_queue", SCHEMA, QUEUE))
        await conn.execute(render_runtime("create_queue", SCHEMA, QUEUE))
        await conn.execute(render_runtime("register_queue", SCHEMA), QUEUE)
        started = time.perf_counter()
        await conn.execute(render("dashbench_seed_x", SCHEMA, QUEUE), rows, timeout=None)
        await conn.execute(render("dashbench_seed_open", SCHEMA, QUEUE), 2000, 200, 600)
        await conn.execute(render("bench_vacuum", SCHEMA, QUEUE), timeout=None)
        print(f"filled {rows:,} X rows in {time.perf_counter() - started:.0f} s")
        return rows + 2800
    finally:
        await conn.close()


async def median(call: Callable[[], Awaitable[Any]], repeat: int) -> float:
    await call()  # warm: plans, pool, caches
    took = []
    for _ in range(repeat):
        started = time.perf_counter()
        await call()
        took.append(time.perf_counter() - started)
    return statistics.median(took)


async def main(dsn: str, rows: int, repeat: int, fresh: bool) -> None:
    total = await seed(dsn, rows, fresh)
    async with Admin(dsn, SCHEMA, pool_size=2) as admin:
        status = (await admin.queue_status(300.0, windows=[3600.0]))[0]
        figures = {
            "queues page refresh (status + 12-bucket history)": await median(
                lambda: overview(admin), repeat
            ),
            "queue page refresh (detail + 60-bucket history)": await median(
                lambda: asyncio.gather(admin.queue_detail(QUEUE), admin.queue_history(QUEUE)),
                repeat,
            ),
            "failed page, error filter": await median(
                lambda: admin.failed_page(QUEUE, error_contains="declined"), repeat
            ),
            "/metrics scrape": await median(lambda: exposition(admin), repeat),
        }
        ceiling = await median(lambda: admin.queue_status(exact=True), max(repeat // 3, 1))
        conn = await asyncpg.connect(dsn)
        try:
            count_sql = render("bench_count_all", SCHEMA, QUEUE)
            count_all_s = await median(lambda: conn.fetchval(count_sql), max(repeat // 3, 1))
        finally:
            await conn.close()
    load = os.getloadavg()
    print(
        f"queue {SCHEMA}.{QUEUE}: {total:,} rows; X shown as {status.processed:,} "
        f"({'estimated' if status.processed_estimated else 'exact'}); "
        f"60-min window {status.windows[1].processed:,} rows"
        f"{' (capped)' if status.windows[1].sampled else ''}"
    )
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    print(f"ceiling: full pass (status --exact) {ceiling * 1000:8.1f} ms")
    print(f"ceiling: SELECT count(*)            {count_all_s * 1000:8.1f} ms")
    for name, seconds in figures.items():
        print(
            f"{name:52s} {seconds * 1000:8.1f} ms  "
            f"{seconds / ceiling:6.3f} of the full pass, {seconds / count_all_s:6.3f} of count(*)"
        )


class _WithoutDoneIndex(Scratch):
    async def create_queue(self, queue: str = BENCH_QUEUE) -> None:
        await super().create_queue(queue)
        await self.c.execute(render("dashbench_drop_done_index", self.schema, queue))


async def index_cost(dsn: str, messages: int, repeat: int) -> None:
    options = BenchOptions(dsn=dsn, messages=messages)
    rates: dict[str, list[float]] = {"with the done index": [], "without it": []}
    for _ in range(repeat):
        for name, kind in (("with the done index", Scratch), ("without it", _WithoutDoneIndex)):
            async with kind(dsn) as scratch:
                rates[name].append(await measure_drain(options, scratch))
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    for name, found in rates.items():
        shown = ", ".join(f"{r:,.0f}" for r in found)
        print(f"drain {name:22s} median {statistics.median(found):8,.0f} msg/s  ({shown})")
    ratio = statistics.median(rates["with the done index"]) / statistics.median(rates["without it"])
    print(f"with / without: {ratio:.3f}")


async def seed_many(dsn: str, queues: int, fresh: bool) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        if fresh:
            await conn.execute(render("drop_schema", MANY_SCHEMA))
        await install_schema(conn, MANY_SCHEMA)
        names = [f"q{k:04d}" for k in range(1, queues + 1)]
        known = await conn.fetch(render_runtime("list_queues", MANY_SCHEMA), MANY_SCHEMA)
        if [r[0] for r in known] == names:
            return
        if known:
            raise SystemExit(f"{MANY_SCHEMA} holds other queues: run with --fresh")
        started = time.perf_counter()
        for k, name in enumerate(names, start=1):
            await conn.execute(render_runtime("create_queue", MANY_SCHEMA, name))
            await conn.execute(render_runtime("register_queue", MANY_SCHEMA), name)
            failed = 3 if k % 10 == 0 else 0
            await conn.execute(render("dashbench_many_seed", MANY_SCHEMA, name), 20, k % 5, failed)
        await conn.execute(render("dashbench_analyze", MANY_SCHEMA))
        print(f"made {queues} queues in {time.perf_counter() - started:.0f} s")
    finally:
        await conn.close()


async def asgi_get(app: Any, path: str, query: str = "") -> tuple[int, bytes]:
    """One GET answered by an ASGI application in this process: status and body."""
    status = 0
    body: list[bytes] = []
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            body.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(body)


async def many_queues(dsn: str, queues: int, repeat: int, fresh: bool) -> None:
    from nmbus.dashboard import DashboardOptions, create_app

    await seed_many(dsn, queues, fresh)
    async with Admin(dsn, MANY_SCHEMA, pool_size=4) as admin:
        app = create_app(admin, DashboardOptions(token="bench-token-not-used"))
        found: dict[str, tuple[float, bytes]] = {}
        for path in ("/", "/fragment/queues", "/metrics"):
            answers: list[bytes] = []

            async def get(path: str = path, answers: list[bytes] = answers) -> None:
                status, body = await asgi_get(app, path)
                if status != 200:
                    raise SystemExit(f"GET {path}: {status} {body[:300]!r}")
                answers.append(body)

            found[path] = (await median(get, repeat), answers[-1])
    load = os.getloadavg()
    print(f"schema {MANY_SCHEMA}: {queues} queues")
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    for path, (seconds, body) in found.items():
        extra = ""
        if path == "/metrics":
            series = [line for line in body.decode().splitlines() if not line.startswith("#")]
            extra = f", {len(series):,} series"
        else:
            extra = f", {body.count(b'<tr data-queue='):,} queue rows"
        print(f"GET {path:18s} median {seconds * 1000:8.1f} ms, {len(body):>9,} bytes{extra}")


def cli() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("NMBUS_DSN"), required=False)
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--fresh", action="store_true", help="drop and refill the queue")
    parser.add_argument("--index-cost", action="store_true", help="drain with/without the index")
    parser.add_argument("--messages", type=int, default=20_000, help="for --index-cost")
    parser.add_argument("--queues", type=int, default=0, help="measure / and /metrics instead")
    args = parser.parse_args()
    if not args.dsn:
        parser.error("pass --dsn or set NMBUS_DSN")
    if args.index_cost:
        asyncio.run(index_cost(args.dsn, args.messages, args.repeat))
    elif args.queues:
        asyncio.run(many_queues(args.dsn, args.queues, args.repeat, args.fresh))
    else:
        asyncio.run(main(args.dsn, args.rows, args.repeat, args.fresh))


if __name__ == "__main__":
    cli()
