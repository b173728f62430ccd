"""The ground every benchmark stands on: its options, its message, its scratch schema.

Every measurement runs in a schema of its own (``nmbus_bench_<random>``) that
:class:`Scratch` creates and drops, so a benchmark never touches the queues of
the database it is pointed at.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import asyncpg

from nmbus.bench.sql import render
from nmbus.bus import Bus
from nmbus.consume.sizing import MOST
from nmbus.context import Context
from nmbus.messages import Message, type_name
from nmbus.postgres.pubsub import create_queue_on
from nmbus.postgres.schema import install_schema
from nmbus.postgres.segments import advance
from nmbus.settings import Settings

QUEUE = "bench"


class Tick(Message, type_name="nmbus.bench.Tick"):
    """The message every benchmark sends: a number, and for latency a send time."""

    n: int
    sent: float = 0.0


TICK = type_name(Tick)
#: The worker loops of a process with the default settings: the bench's default too.
DEFAULT_LOOPS: int = Settings.model_fields["concurrency"].default


@dataclass
class BenchOptions:
    """What to measure and how much of it.

    The repository's bench/ adds the options of its own modes in a subclass.
    """

    dsn: str = field(repr=False)  # it may hold a password
    messages: int = 50_000
    batch_size: int | None = None  # None: each loop adapts it, as a worker's default
    concurrency: int = DEFAULT_LOOPS
    baseline_messages: int = 5_000
    rate: float = 200.0
    seconds: float = 10.0
    warmup: float = 1.0
    x_rows: int = 5_000_000
    segments: int = 30
    repeat: int = 1
    processes: int = 1
    sagas: int = 3

    @property
    def claim_size(self) -> int:
        """The rows a bare claim takes (the ceilings): ``batch_size``, else the most
        an adaptive loop claims."""
        return self.batch_size or MOST

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


class Scratch:
    """A schema of the bench's own with one queue table; dropped on exit."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.schema = f"nmbus_bench_{uuid.uuid4().hex[:10]}"
        self.conn: asyncpg.Connection | None = None

    async def __aenter__(self) -> Scratch:
        self.conn = await asyncpg.connect(self.dsn)
        await install_schema(self.conn, self.schema)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.conn is not None
        try:
            await self.conn.execute(render("drop_schema", self.schema))
        finally:
            await self.conn.close()

    @property
    def c(self) -> asyncpg.Connection:
        assert self.conn is not None
        return self.conn

    async def create_queue(self, queue: str = QUEUE) -> None:
        async with self.c.transaction():
            await create_queue_on(self.c, self.schema, queue)

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


def noop_bus(options: BenchOptions, schema: str) -> tuple[Bus, list[float]]:
    """A bus on the bench queue whose one handler does nothing, and the list its
    first call puts its ``perf_counter`` time in (a drain is timed from there)."""
    bus = Bus(QUEUE, settings=options.bus_settings(schema))
    first: list[float] = []

    @bus.handler
    async def noop(msg: Tick, ctx: Context) -> None:
        if not first:
            first.append(time.perf_counter())

    return bus, first


async def load_segments(
    scratch: Scratch, rows: int, segments: int, age: timedelta | None = None
) -> None:
    """``rows`` X rows in ``segments`` segments (processed ``age`` ago, or now), then a
    new segment to write to."""
    per = max(1, rows // max(1, segments))
    left = rows
    while left > 0:
        if age is None:
            await scratch.preload(min(per, left), "X")
        else:
            await scratch.c.execute(
                render("bench_preload_aged", scratch.schema, QUEUE),
                min(per, left),
                age,
                TICK,
                f"X{left}-",
            )
        left -= per
        await advance(scratch.c, scratch.schema, QUEUE)
