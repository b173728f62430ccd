"""The demo: a small shop of four services on the bus, then the statistics report.

::

    shop ──OrderPlaced──▶ billing ──PaymentTaken──▶ warehouse ──OrderShipped──┐
      │                                                                       ▼
      └──────────────────────OrderPlaced──────────────────────────────▶ notifications

``shop`` publishes orders; ``billing`` charges them (writing a payment row in
the same transaction as the message, through ``ctx.connection``) and publishes
``PaymentTaken``; ``warehouse`` ships and publishes ``OrderShipped``;
``notifications`` subscribes to both ends. Handlers fail on purpose: the
payment gateway and the stock service time out now and then (the message goes
to R and is retried with backoff), some cards are declined for good
(``PermanentError``: straight to F), and the mail server greylists
(``RetryLater``: tried again later without counting an attempt).

Everything lives in its own schema (``nmbus_demo``), dropped and created again
at each run, so the figures are those of the last run. The command line
(``nmbus demo``) adds the embedded PostgreSQL (:mod:`nmbus.demo.embedded`),
the live view and the report (:mod:`nmbus.demo.report`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import asyncpg
import structlog

from nmbus.bus import Bus
from nmbus.context import Context
from nmbus.demo.sql import render
from nmbus.errors import ConfigurationError, NmbusError, PermanentError, RetryLater
from nmbus.messages import Message
from nmbus.names import validate_schema_name
from nmbus.postgres import sql as core_sql
from nmbus.retry import RetryPolicy
from nmbus.settings import Settings

log = structlog.get_logger("nmbus.demo")

DEFAULT_SCHEMA = "nmbus_demo"
PUBLISHER = "shop"
# Upstream first: once a queue is seen empty, nothing upstream can feed it any more.
QUEUES = ("billing", "warehouse", "notifications")


class OrderPlaced(Message, type_name="demo.OrderPlaced"):
    order_id: int
    customer: str
    amount: float


class PaymentTaken(Message, type_name="demo.PaymentTaken"):
    order_id: int
    amount: float


class OrderShipped(Message, type_name="demo.OrderShipped"):
    order_id: int
    carrier: str


class GatewayTimeout(NmbusError):
    """A transient failure: the message is retried after a backoff."""


@dataclass(frozen=True)
class DemoOptions:
    """How big the demo is and how often its handlers fail."""

    orders: int = 3000
    schema: str = DEFAULT_SCHEMA
    concurrency: int = 2
    flaky_rate: float = 0.12
    decline_rate: float = 0.02
    greylist_rate: float = 0.03
    max_attempts: int = 4
    retry_delay: float = 0.2
    publishers: int = 4
    seed: int = 7
    timeout: float = 600.0

    def check(self) -> None:
        validate_schema_name(self.schema)
        if self.orders < 1:
            raise ConfigurationError("--orders must be at least 1")
        if self.concurrency < 1:  # no worker loop: the demo would wait for ever
            raise ConfigurationError("--concurrency must be at least 1")
        for name in ("flaky_rate", "decline_rate", "greylist_rate"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                option = "--" + name.replace("_", "-")
                raise ConfigurationError(f"{option} must be at least 0 and below 1, got {value}")


@dataclass
class QueueCounts:
    queue: str
    ready: int = 0
    scheduled: int = 0
    processed: int = 0
    failed: int = 0

    @property
    def pending(self) -> int:
        return self.ready + self.scheduled


@dataclass
class Snapshot:
    """What the live view shows: published orders and every queue's subqueues."""

    orders: int
    published: int
    queues: list[QueueCounts]
    elapsed: float
    attempts_failed: int = 0
    declined: int = 0
    # Of attempts_failed, those the policy retried (a last attempt's failure goes to F).
    attempts_retried: int = 0

    @property
    def settled(self) -> int:
        """Orders billing has finished with, processed or failed."""
        billing = next(q for q in self.queues if q.queue == "billing")
        return billing.processed + billing.failed

    @property
    def done(self) -> bool:
        return self.published == self.orders and all(q.pending == 0 for q in self.queues)


@dataclass
class BusResult:
    """The outcome of the bus part of the demo."""

    snapshot: Snapshot
    payments: int
    retried: dict[str, int]
    top_errors: list[tuple[str, str, int]]
    seconds: float


@dataclass
class Chaos:
    """Decides, reproducibly per order and attempt, which handler calls fail."""

    options: DemoOptions
    attempts_failed: int = 0
    attempts_retried: int = 0
    declined: set[int] = field(default_factory=set)

    def _draw(self, *key: object) -> float:
        # A real hash: crc32 of keys that differ in one digit is correlated, and a
        # second attempt would then never fail where the first one did.
        digest = hashlib.blake2b(repr((self.options.seed, *key)).encode(), digest_size=8)
        return int.from_bytes(digest.digest()) / 2**64

    def flaky(self, where: str, order_id: int, attempt: int) -> bool:
        failed = self._draw(where, order_id, attempt) < self.options.flaky_rate
        self.attempts_failed += failed
        # ``attempt`` counts this one; at max_attempts the failure is final (F), not retried.
        self.attempts_retried += failed and attempt < self.options.max_attempts
        return failed

    def declines(self, order_id: int) -> bool:
        return self._draw("decline", order_id) < self.options.decline_rate

    def greylists(self) -> bool:
        # Not per attempt: RetryLater does not count one, so a fixed draw would loop.
        return self._rng.random() < self.options.greylist_rate

    def __post_init__(self) -> None:
        self._rng = random.Random(self.options.seed)


# -- the services -------------------------------------------------------------------


def build_services(dsn: str, options: DemoOptions, chaos: Chaos) -> dict[str, Bus]:
    """The four endpoints of the demo, with their handlers and subscriptions."""
    base = Settings(
        dsn=dsn,
        schema_name=options.schema,
        concurrency=options.concurrency,
        batch_size=50,
        poll_interval=1.0,
        lease_seconds=30.0,
        send_pool_size=2,
        shutdown_timeout=10.0,
    )
    policy = RetryPolicy(
        max_attempts=options.max_attempts,
        initial_delay=options.retry_delay,
        backoff=2.0,
        max_delay=max(options.retry_delay, 5.0),
    )
    shop = Bus(PUBLISHER, settings=base.model_copy(update={"concurrency": 0}))
    billing = Bus("billing", settings=base, retry=policy)
    warehouse = Bus("warehouse", settings=base, retry=policy)
    notifications = Bus("notifications", settings=base, retry=policy)
    insert_payment = render("demo_insert_payment", options.schema)

    @billing.handler
    async def charge(msg: OrderPlaced, ctx: Context) -> None:
        if chaos.declines(msg.order_id):
            chaos.declined.add(msg.order_id)
            raise PermanentError("card declined by the issuer (do not honour)")
        if chaos.flaky("billing", msg.order_id, ctx.retry_count):
            raise GatewayTimeout("payment gateway timed out after 3.0s")
        # The payment row, the PaymentTaken copies and the move to X commit together.
        await ctx.connection.execute(insert_payment, msg.order_id, msg.amount)
        await ctx.publish(PaymentTaken(order_id=msg.order_id, amount=msg.amount))

    @warehouse.handler
    async def ship(msg: PaymentTaken, ctx: Context) -> None:
        if chaos.flaky("warehouse", msg.order_id, ctx.retry_count):
            raise GatewayTimeout("stock service busy (HTTP 503)")
        carrier = ("DHL", "UPS", "PostNL")[msg.order_id % 3]
        await ctx.publish(OrderShipped(order_id=msg.order_id, carrier=carrier))

    @notifications.handler
    async def order_received(msg: OrderPlaced, ctx: Context) -> None:
        if chaos.greylists():
            raise RetryLater(0.5, "mail server greylisted us")

    @notifications.handler
    async def order_shipped(msg: OrderShipped, ctx: Context) -> None:
        if chaos.greylists():
            raise RetryLater(0.5, "mail server greylisted us")
        if chaos.flaky("notifications", msg.order_id, ctx.retry_count):
            raise GatewayTimeout("SMTP connection reset")

    billing.subscribe(OrderPlaced, publisher=PUBLISHER)
    notifications.subscribe(OrderPlaced, publisher=PUBLISHER)
    warehouse.subscribe(PaymentTaken, publisher="billing")
    notifications.subscribe(OrderShipped, publisher="warehouse")
    return {
        PUBLISHER: shop,
        "billing": billing,
        "warehouse": warehouse,
        "notifications": notifications,
    }


# -- the schema -----------------------------------------------------------------------


async def reach(dsn: str) -> None:
    """Connect once: a server or database that is not there fails before any progress."""
    conn = await asyncpg.connect(dsn, timeout=10)
    await conn.close()


async def reset_schema(dsn: str, schema: str) -> None:
    """Drop the previous demo's schema and create the payments table.

    Refuses to touch a schema of that name that is not a demo schema.
    """
    validate_schema_name(schema)
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        if await conn.fetchval(render("demo_schema_exists", schema), schema):
            if not await conn.fetchval(render("demo_is_demo_schema", schema), schema):
                raise ConfigurationError(
                    f"schema {schema!r} exists and is not a demo schema (it has no "
                    "demo_payments table); pick another one with --schema"
                )
            await conn.execute(render("demo_drop_schema", schema))
        await conn.execute(render("demo_create_tables", schema))
    finally:
        await conn.close()


async def drop_schema(dsn: str, schema: str) -> bool:
    """Drop the demo schema; False when there was none. Refuses non-demo schemas."""
    validate_schema_name(schema)
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        if not await conn.fetchval(render("demo_schema_exists", schema), schema):
            return False
        if not await conn.fetchval(render("demo_is_demo_schema", schema), schema):
            raise ConfigurationError(f"schema {schema!r} is not a demo schema; left alone")
        await conn.execute(render("demo_drop_schema", schema))
        return True
    finally:
        await conn.close()


# -- the run ----------------------------------------------------------------------------


async def _snapshot(
    pool: asyncpg.Pool, options: DemoOptions, published: int, started: float, chaos: Chaos
) -> Snapshot:
    queues = []
    for queue in QUEUES:
        rows = await pool.fetch(core_sql.render("subqueue_counts", options.schema, queue))
        counts = {row[0]: int(row[1]) for row in rows}
        queues.append(
            QueueCounts(
                queue,
                ready=counts.get("I", 0),
                scheduled=counts.get("R", 0),
                processed=counts.get("X", 0),
                failed=counts.get("F", 0),
            )
        )
    return Snapshot(
        orders=options.orders,
        published=published,
        queues=queues,
        elapsed=time.monotonic() - started,
        attempts_failed=chaos.attempts_failed,
        declined=len(chaos.declined),
        attempts_retried=chaos.attempts_retried,
    )


async def run_bus(
    dsn: str,
    options: DemoOptions,
    on_progress: Callable[[Snapshot], None] | None = None,
    interval: float = 0.25,
) -> BusResult:
    """Run the services, publish ``options.orders`` orders and wait until all settle."""
    options.check()
    await reset_schema(dsn, options.schema)
    chaos = Chaos(options)
    buses = build_services(dsn, options, chaos)
    started = time.monotonic()
    published = 0
    rng = random.Random(options.seed)
    orders = [
        OrderPlaced(
            order_id=n,
            customer=f"customer-{rng.randrange(1, 500):03d}",
            amount=round(rng.uniform(5, 250), 2),
        )
        for n in range(1, options.orders + 1)
    ]

    async def publisher(share: list[OrderPlaced]) -> None:
        nonlocal published
        for order in share:
            await buses[PUBLISHER].publish(order)
            published += 1

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        async with contextlib.AsyncExitStack() as stack:
            # Subscribers first: their subscriptions must exist before the first publish.
            for name in (*QUEUES, PUBLISHER):
                await stack.enter_async_context(buses[name])
            log.info("demo_started", orders=options.orders, schema=options.schema)
            n = max(1, options.publishers)
            tasks = [asyncio.create_task(publisher(orders[i::n])) for i in range(n)]
            try:
                async with asyncio.timeout(options.timeout):
                    while True:
                        for task in [t for t in tasks if t.done()]:
                            task.result()  # a failed publisher fails the demo
                        snap = await _snapshot(pool, options, published, started, chaos)
                        if on_progress is not None:
                            on_progress(snap)
                        if snap.done and all(t.done() for t in tasks):
                            break
                        await asyncio.sleep(interval)
            except TimeoutError as exc:
                raise TimeoutError(
                    f"the demo did not settle within {options.timeout:g}s: {snap}"
                ) from exc
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        seconds = time.monotonic() - started
        payments = await pool.fetchval(render("demo_count_payments", options.schema))
        retried = {}
        top: list[tuple[str, str, int]] = []
        for queue in QUEUES:
            retried[queue] = await pool.fetchval(
                render("demo_retried_count", options.schema, queue)
            )
            for row in await pool.fetch(render("demo_top_errors", options.schema, queue), 3):
                top.append((queue, row["error"], row["n"]))
    finally:
        await pool.close()
    log.info("demo_bus_finished", seconds=round(seconds, 2), payments=payments)
    return BusResult(
        snapshot=snap,
        payments=payments,
        retried=retried,
        top_errors=sorted(top, key=lambda t: -t[2]),
        seconds=seconds,
    )
