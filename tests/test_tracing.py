"""OpenTelemetry: trace context in the headers, PRODUCER and CONSUMER spans, two hops.

Each bus gets the test's own SDK tracer provider (``Bus(tracer_provider=...)``)
with an in-memory exporter, so nothing global is set for the other tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncpg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from nmbus import Bus, Context, Message, RetryLater
from nmbus.messages import Envelope
from tests.messages import Hop1, Hop2
from tests.waits import wait_until


class Failing(Message, type_name="otel.Failing"):
    n: int


class Later(Message, type_name="otel.Later"):
    n: int


class Announced(Message, type_name="otel.Announced"):
    n: int


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    found = InMemorySpanExporter()
    yield found
    found.shutdown()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield tracer_provider
    tracer_provider.shutdown()


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def only(spans: tuple[ReadableSpan, ...], name: str) -> ReadableSpan:
    found = by_name(spans, name)
    assert len(found) == 1, f"{len(found)} spans named {name!r}: {[s.name for s in spans]}"
    return found[0]


def ids(span: ReadableSpan) -> tuple[int, int]:
    assert span.context is not None
    return span.context.trace_id, span.context.span_id


def parent_of(span: ReadableSpan) -> int:
    assert span.parent is not None, f"{span.name} has no parent"
    return span.parent.span_id


async def wait_spans(exporter: InMemorySpanExporter, name: str, count: int = 1) -> None:
    await wait_until(
        lambda: len(by_name(exporter.get_finished_spans(), name)),
        until=lambda finished: finished >= count,
        timeout=60,
        interval=0.02,
        what=f"{count} finished span(s) {name!r}",
    )


async def test_a_send_in_a_span_is_the_parent_of_its_handler_across_two_hops(
    make_bus: Callable[..., Bus],
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    db: asyncpg.Connection,
) -> None:
    sender = make_bus("a", concurrency=0, tracer_provider=provider)
    b = make_bus("b", tracer_provider=provider)
    c = make_bus("c", tracer_provider=provider)
    seen: dict[str, str] = {}

    @b.handler
    async def forward(msg: Hop1, ctx: Context) -> None:
        seen["b_carried"] = ctx.headers["traceparent"]
        seen["hop2_id"] = await ctx.send(Hop2(n=msg.n), to="c")

    @c.handler
    async def last(msg: Hop2, ctx: Context) -> None:
        seen["c_carried"] = ctx.headers["traceparent"]
        seen["c_unique_id"] = ctx.unique_id
        seen["c_correlation"] = ctx.correlation_id or ""

    tracer = provider.get_tracer("tests")
    async with sender, b, c:
        with tracer.start_as_current_span("checkout") as root:
            uid = await sender.send(Hop1(n=7), to="b", correlation_id="order-7")
        await wait_spans(exporter, "process c")
    spans = exporter.get_finished_spans()
    send_b = only(spans, "send b")
    process_b = only(spans, "process b")
    send_c = only(spans, "send c")
    process_c = only(spans, "process c")

    # One trace, and each span the child of the one before it.
    trace_id, root_id = root.get_span_context().trace_id, root.get_span_context().span_id
    assert {ids(s)[0] for s in (send_b, process_b, send_c, process_c)} == {trace_id}
    assert parent_of(send_b) == root_id
    assert parent_of(process_b) == ids(send_b)[1]
    assert parent_of(send_c) == ids(process_b)[1]
    assert parent_of(process_c) == ids(send_c)[1]
    assert [s.kind for s in (send_b, process_b, send_c, process_c)] == [
        SpanKind.PRODUCER,
        SpanKind.CONSUMER,
        SpanKind.PRODUCER,
        SpanKind.CONSUMER,
    ]
    # The headers hold the sending span's context (W3C traceparent).
    assert seen["b_carried"].startswith(f"00-{trace_id:032x}-{ids(send_b)[1]:016x}-")
    # The handler's own span won over the traceparent that hop 1 carried in.
    assert seen["c_carried"].startswith(f"00-{trace_id:032x}-{ids(send_c)[1]:016x}-")
    stored = await db.fetchval("SELECT msg_headers FROM nmbus.c")
    assert json.loads(stored)["traceparent"] == seen["c_carried"]

    assert send_b.attributes == {
        "messaging.system": "nmbus",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": "b",
        "messaging.message.id": uid,
        "messaging.message.conversation_id": "order-7",
    }
    attrs = dict(process_b.attributes or {})
    row_id = attrs.pop("messaging.nmbus.row_id")
    assert isinstance(row_id, int) and row_id > 0
    assert attrs == {
        "messaging.system": "nmbus",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "b",
        "messaging.message.id": uid,
        "messaging.message.conversation_id": "order-7",
        "messaging.nmbus.retry_count": 1,
        "messaging.nmbus.from_endpoint": "a",
        "messaging.nmbus.message_type": "otel.Hop1",
    }
    assert process_c.attributes is not None
    assert process_c.attributes["messaging.message.id"] == seen["c_unique_id"] == seen["hop2_id"]
    assert process_c.attributes["messaging.destination.name"] == "c"
    assert process_c.attributes["messaging.nmbus.from_endpoint"] == "b"
    # The correlation id travels with the conversation.
    assert seen["c_correlation"] == "order-7"
    assert process_c.attributes["messaging.message.conversation_id"] == "order-7"
    assert send_c.attributes is not None
    assert send_c.attributes["messaging.message.id"] == seen["hop2_id"]
    for span in spans:
        assert span.status.status_code is StatusCode.UNSET, span.name


async def test_concurrent_handlers_each_parent_their_own_sends(
    make_bus: Callable[..., Bus], provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    # Handlers of one batch interleave (handler_concurrency): each send must
    # still be the child of its own handler's span, never a neighbour's.
    bus = make_bus("fan", tracer_provider=provider, handler_concurrency=5, batch_size=5)
    out = make_bus("fan_out", tracer_provider=provider, concurrency=0)

    @bus.handler
    async def forward(msg: Hop1, ctx: Context) -> None:
        await asyncio.sleep(0.05 * (5 - msg.n))  # finish in the reverse order
        await ctx.send(Hop2(n=msg.n), to="fan_out")

    async with out:
        for n in range(5):
            await out.send(Hop1(n=n), to="fan")
        async with bus:
            await wait_spans(exporter, "send fan_out", 5)
    spans = exporter.get_finished_spans()
    handlers = {ids(s)[1]: s for s in by_name(spans, "process fan")}
    sent = {(s.attributes or {})["messaging.message.id"]: s for s in by_name(spans, "send fan")}
    assert len(handlers) == 5 and len(sent) == 5
    for send in by_name(spans, "send fan_out"):
        handler = handlers[parent_of(send)]
        origin = sent[(handler.attributes or {})["messaging.message.id"]]
        assert parent_of(handler) == ids(origin)[1]
        assert ids(send)[0] == ids(handler)[0] == ids(origin)[0]
    assert len({ids(s)[0] for s in by_name(spans, "send fan")}) == 5  # five separate traces


async def test_a_failing_handler_marks_its_span_and_every_attempt_has_one(
    make_bus: Callable[..., Bus], provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    bus = make_bus("failing", tracer_provider=provider, max_attempts=2, retry_delay=0.0)

    @bus.handler
    async def boom(msg: Failing, ctx: Context) -> None:
        raise ValueError(f"no stock for {msg.n}")

    async with bus:
        await bus.send(Failing(n=3), to="failing")
        await wait_spans(exporter, "process failing", 2)
    attempts = sorted(
        by_name(exporter.get_finished_spans(), "process failing"),
        key=lambda s: (s.attributes or {})["messaging.nmbus.retry_count"],
    )
    assert [(s.attributes or {})["messaging.nmbus.retry_count"] for s in attempts] == [1, 2]
    send = only(exporter.get_finished_spans(), "send failing")
    for span in attempts:
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description == "ValueError: no stock for 3"
        (event,) = [e for e in span.events if e.name == "exception"]
        assert event.attributes is not None
        assert event.attributes["exception.type"] == "ValueError"
        assert parent_of(span) == ids(send)[1]


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


async def test_an_exception_that_cannot_be_printed_still_ends_its_span_and_fails_its_message(
    make_bus: Callable[..., Bus],
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    db: asyncpg.Connection,
) -> None:
    bus = make_bus("failing", tracer_provider=provider, max_attempts=1)

    @bus.handler
    async def boom(msg: Failing, ctx: Context) -> None:
        raise Unprintable

    async with bus:
        await bus.send(Failing(n=1), to="failing")
        await wait_spans(exporter, "process failing")
        await wait_until("SELECT count(*) FROM nmbus.failing WHERE subqueue = 'F'", db=db)
    span = only(exporter.get_finished_spans(), "process failing")
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "Unprintable"
    info = await db.fetchval("SELECT error_info FROM nmbus.failing")
    assert info.startswith("Unprintable"), info  # the handler's error, not the span's


async def test_retry_later_is_not_an_error(
    make_bus: Callable[..., Bus], provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    bus = make_bus("later", tracer_provider=provider)
    calls = 0

    @bus.handler
    async def later(msg: Later, ctx: Context) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RetryLater(seconds=0.0)

    async with bus:
        await bus.send(Later(n=1), to="later")
        await wait_spans(exporter, "process later", 2)
    first, second = by_name(exporter.get_finished_spans(), "process later")
    assert first.status.status_code is StatusCode.UNSET
    assert [e.name for e in first.events] == ["nmbus.retry_later"]
    assert second.events == () or list(second.events) == []


async def test_publish_is_a_producer_span_parent_of_each_subscriber(
    make_bus: Callable[..., Bus], provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    publisher = make_bus("shop", concurrency=0, tracer_provider=provider)
    subscribers = [make_bus(name, tracer_provider=provider) for name in ("mail", "stats")]
    for bus in subscribers:
        bus.subscribe(Announced, publisher="shop")

        @bus.handler
        async def on_it(msg: Announced, ctx: Context) -> None:
            pass

    async with subscribers[0], subscribers[1], publisher:
        await publisher.publish(Announced(n=1))
        await publisher.publish_many([Announced(n=2), Announced(n=3)])
        await wait_spans(exporter, "process mail", 3)
        await wait_spans(exporter, "process stats", 3)
    spans = exporter.get_finished_spans()
    single = only(spans, "publish otel.Announced")
    many = only(spans, "publish messages")
    assert single.kind is SpanKind.PRODUCER and many.kind is SpanKind.PRODUCER
    assert (many.attributes or {})["messaging.batch.message_count"] == 2
    consumers = by_name(spans, "process mail") + by_name(spans, "process stats")
    parents = sorted(parent_of(s) for s in consumers)
    assert parents == sorted([ids(single)[1]] * 2 + [ids(many)[1]] * 4)


async def test_bad_trace_headers_never_stop_a_message(
    make_bus: Callable[..., Bus], provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    bus = make_bus("odd", tracer_provider=provider)
    handled: list[int] = []

    @bus.handler
    async def on_it(msg: Hop1, ctx: Context) -> None:
        handled.append(msg.n)

    async with bus:
        for n, headers in enumerate(
            [{"traceparent": "garbage"}, {"traceparent": 5, "tracestate": ["x"]}, {"other": "1"}]
        ):
            envelope = Envelope(
                "otel.Hop1", json.dumps({"n": n}), json.dumps(headers), f"odd-{n}", None, None
            )
            await bus.store.insert("odd", "elsewhere", [envelope])
        await wait_spans(exporter, "process odd", 3)
    assert sorted(handled) == [0, 1, 2]
    for span in by_name(exporter.get_finished_spans(), "process odd"):
        assert span.parent is None  # a root span of its own trace


async def test_without_a_configured_provider_nothing_is_recorded_and_context_still_travels(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # The global provider is the API's no-op one here: spans cost nothing and
    # record nothing, and a traceparent that came in is carried on unchanged.
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)
    bus = make_bus("plain")
    assert bus.tracing is not None and not bus.tracing.on()
    incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

    @bus.handler
    async def forward(msg: Hop1, ctx: Context) -> None:
        await ctx.send(Hop2(n=msg.n), to="plain_out")

    async with bus:
        await bus.store.ensure_queue("plain_out")
        await bus.send(Hop1(n=1), to="plain", headers={"traceparent": incoming})
        await wait_until("SELECT count(*) FROM nmbus.plain_out", db=db, timeout=60, interval=0.02)
    stored = json.loads(await db.fetchval("SELECT msg_headers FROM nmbus.plain_out"))
    assert stored["traceparent"] == incoming


GLOBAL_PROVIDER = """
import asyncio, json, sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from nmbus import Bus, Context
from tests.messages import Hop1

async def main():
    bus = Bus("global_otel", dsn=sys.argv[1], concurrency=0, subscription_ttl=None)

    @bus.handler
    async def on_it(msg: Hop1, ctx: Context) -> None:
        pass

    before = bus.tracing.on()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # after the bus was built: it notices
    async with bus:
        with trace.get_tracer("app").start_as_current_span("request"):
            await bus.send(Hop1(n=1), to="global_otel")
        await bus.worker.run_burst()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    print(json.dumps({
        "before": before,
        "names": sorted(spans),
        "chain": [
            spans["send global_otel"].parent.span_id == spans["request"].context.span_id,
            spans["process global_otel"].parent.span_id
            == spans["send global_otel"].context.span_id,
        ],
    }))

asyncio.run(main())
"""


def test_the_global_provider_is_used_once_the_application_sets_it(dsn: str) -> None:
    # In a child process: the global provider can be set once per process.
    env = {k: v for k, v in os.environ.items() if not k.startswith("NMBUS_")}
    done = subprocess.run(
        [sys.executable, "-c", GLOBAL_PROVIDER, dsn],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {
        "before": False,
        "names": ["process global_otel", "request", "send global_otel"],
        "chain": [True, True],
    }


async def test_a_replayed_batch_shows_the_failure_that_caused_it(
    make_bus: Callable[..., Bus],
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    db: asyncpg.Connection,
) -> None:
    # Handlers without outside effects run their batch without savepoints; the
    # one that fails after writing makes the batch run again, its own failure
    # standing. Its span must say so: ERROR, with the replay as an event.
    await db.execute("CREATE TABLE effects (n int)")
    bus = make_bus("replaying", tracer_provider=provider, max_attempts=1, batch_size=10)

    @bus.handler(outside_effects=False)
    async def write(msg: Failing, ctx: Context) -> None:
        await ctx.connection.execute("INSERT INTO effects (n) VALUES ($1)", msg.n)
        if msg.n == 2:
            raise ValueError("fails after its write")

    async with Bus("sender", dsn=bus.settings.dsn, concurrency=0) as sender:
        for n in range(1, 4):
            await sender.send(Failing(n=n), to="replaying")
    async with bus:
        # 1 runs twice (the rolled-back run, then the one that commits), 2 once
        # (its failure stands), 3 once (the first run stopped at 2).
        await wait_spans(exporter, "process replaying", 4)
    assert bus.worker.replays == 1
    spans = by_name(exporter.get_finished_spans(), "process replaying")
    failed = [s for s in spans if s.status.status_code is StatusCode.ERROR]
    assert len(spans) == 4 and len(failed) == 1
    assert failed[0].status.description == "ValueError: fails after its write"
    assert [e.name for e in failed[0].events] == ["nmbus.replay", "exception"]
    assert sorted(r["n"] for r in await db.fetch("SELECT n FROM effects")) == [1, 3]
