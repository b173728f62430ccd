"""Fast tests without a database: the API surface, registration, retry policy,
and the real worker running on the in-memory store."""

from __future__ import annotations

import asyncio
import inspect
import re

import pytest

import nmbus
from nmbus import Bus, Context, Message, PermanentError, RetryPolicy
from nmbus.envelopes import NO_OPTIONS
from nmbus.errors import ConfigurationError, HandlerError, InvalidQueueName, MessageTooLarge
from nmbus.names import validate_queue_name, validate_schema_name
from nmbus.postgres import PostgresStore
from nmbus.testing import MemoryStore, drain
from tests.messages import Event, OrderPlaced, Ping, Pong


def memory_bus(endpoint: str = "billing", **settings: object) -> Bus:
    return Bus(endpoint, store=MemoryStore(), poll_interval=0.05, **settings)


PUBLIC_API = {
    # The contract of DESIGN.md section 3, and the context's typed effects.
    "Bus", "Context", "Effects", "Message", "RetryPolicy", "Settings",
    # Delivery controls (DESIGN.md section 8), and a send's options, declared once.
    "Tick", "SendOptions", "PublishOptions",
    # Every exception nmbus raises or records, as drawn in nmbus/errors.py.
    "NmbusError", "ConfigurationError", "InvalidQueueName", "InvalidSetting", "HandlerError",
    "MessageError", "MessageTooLarge", "InvalidMessage", "UnknownMessageType", "NoHandler",
    "Expired",
    "UndecodableMessage", "AttemptFailed", "AttemptsExhausted", "HandlerTimeout",
    "HandlerCancelled", "OutcomeNotRecorded", "StoreError", "DatabaseUnavailable",
    "QueueNotFound", "LeaseLost", "SchemaVersionError", "RetentionError", "ToolError",
    "HandlerSignal", "PermanentError", "RetryLater", "SagaNotFound", "UnknownEncryptionKey",
    "MessageVersionError",
    # Message contracts (DESIGN.md section 11).
    "Encrypted",
    # The service bus (DESIGN.md section 8).
    "Saga",
}  # fmt: skip


def test_all_matches_the_public_names() -> None:
    # An exact set: a name added to or dropped from the public API is a decision.
    assert set(nmbus.__all__) == PUBLIC_API
    public = {name for name in dir(nmbus) if not name.startswith("_")}
    modules = {name for name in public if inspect.ismodule(getattr(nmbus, name))}
    assert public - modules == PUBLIC_API


def test_version_is_the_installed_distribution() -> None:
    import importlib.metadata
    import tomllib
    from pathlib import Path

    from typer.testing import CliRunner

    from nmbus.cli import app

    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert nmbus.__version__ == importlib.metadata.version("nmbus")
    assert nmbus.__version__ == pyproject["project"]["version"]
    assert CliRunner().invoke(app, ["--version"]).stdout.strip() == nmbus.__version__


def test_the_license_is_declared_and_shipped() -> None:
    import importlib.metadata
    import tomllib
    from pathlib import Path

    root = Path(__file__).parent.parent
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    # The SPDX form (PEP 639), which needs setuptools 77 to build.
    assert pyproject["project"]["license"] == "MIT"
    assert pyproject["project"]["license-files"] == ["LICENSE"]
    assert "setuptools>=77" in pyproject["build-system"]["requires"]
    text = (root / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) the nmbus authors" in text
    assert importlib.metadata.metadata("nmbus")["License-Expression"] == "MIT"


def test_help_of_bus_describes_every_constructor_argument() -> None:
    doc = inspect.getdoc(Bus) or ""
    for name in inspect.signature(Bus.__init__).parameters:
        if name != "self":
            shown = f"``**{name}``" if name == "overrides" else f"``{name}``"
            assert f"* {shown}:" in doc, name


def test_every_exception_class_is_exported_and_in_the_drawn_tree() -> None:
    import nmbus.errors as errors

    classes = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type)
        and issubclass(value, BaseException)
        and value.__module__ == errors.__name__
    }
    assert classes <= set(nmbus.__all__)
    drawn = set(re.findall(r"[─ ]([A-Z][A-Za-z]+)\b", errors.__doc__ or ""))
    assert classes <= drawn, classes - drawn


@pytest.mark.parametrize(
    "name",
    ['bad"name', "has space", "x; DROP TABLE y", "a" * 200, "", "9lives", "schema_version", 7],
)
def test_hostile_queue_names_are_refused(name: object) -> None:
    with pytest.raises(InvalidQueueName):
        memory_bus(name)  # type: ignore[arg-type]


WHITESPACE_SUFFIXES = ["\n", "\r\n", "\r", " ", "\t", "\x0b", "\x0c", "\n\n", "\u2028"]


@pytest.mark.parametrize("suffix", WHITESPACE_SUFFIXES)
def test_queue_names_with_trailing_whitespace_are_refused(suffix: str) -> None:
    # A regex ending in `$` also matches before a final newline: "billing\n" would
    # pass and make a second table beside "billing".
    with pytest.raises(InvalidQueueName):
        memory_bus("billing" + suffix)
    with pytest.raises(InvalidQueueName):
        validate_queue_name("billing" + suffix)


@pytest.mark.parametrize("suffix", WHITESPACE_SUFFIXES)
def test_schema_names_with_trailing_whitespace_are_refused(suffix: str) -> None:
    with pytest.raises(InvalidQueueName, match="schema name"):
        validate_schema_name("nmbus" + suffix)
    with pytest.raises(InvalidQueueName, match="schema name"):
        PostgresStore("postgresql://unused", schema="nmbus" + suffix)


@pytest.mark.parametrize("suffix", WHITESPACE_SUFFIXES)
def test_type_names_with_trailing_whitespace_are_refused(suffix: str) -> None:
    with pytest.raises(ConfigurationError, match="invalid message type name"):

        class Trailing(Message, type_name="test.Trailing" + suffix):
            x: int


async def test_send_to_a_queue_name_with_a_newline_is_refused() -> None:
    async with memory_bus() as bus:
        with pytest.raises(InvalidQueueName):
            await bus.send(Ping(n=1), to="billing\n")


def test_handler_registration_checks_at_once() -> None:
    bus = memory_bus()
    with pytest.raises(HandlerError, match="async"):

        @bus.handler
        def not_async(msg: Ping, ctx: Context) -> None: ...

    with pytest.raises(HandlerError, match="annotate"):

        @bus.handler
        async def no_annotation(msg, ctx: Context) -> None: ...  # type: ignore[no-untyped-def]

    with pytest.raises(HandlerError, match="not a subclass"):

        @bus.handler
        async def wrong_type(msg: int, ctx: Context) -> None: ...

    with pytest.raises(HandlerError, match=r"exactly \(msg, ctx\)"):

        @bus.handler
        async def too_many(msg: Ping, ctx: Context, extra: int) -> None: ...

    with pytest.raises(TypeError):
        bus.handler(retry="3")(lambda: None)  # type: ignore[call-overload]


def test_retry_normalises_ints_and_policies() -> None:
    assert RetryPolicy.of(3).max_attempts == 3
    policy = RetryPolicy(max_attempts=4, initial_delay=2, backoff=3, max_delay=10, jitter=0)
    assert RetryPolicy.of(policy) is policy
    assert [policy.delay(n) for n in (1, 2, 3)] == [2, 6, 10]
    assert not policy.gives_up_after(3) and policy.gives_up_after(4)
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


def test_type_names_are_explicit_and_clashes_are_refused() -> None:
    assert OrderPlaced.__type_name__ == "test.OrderPlaced"
    with pytest.raises(ConfigurationError, match="used by both"):

        class Clash(Message, type_name="test.Ping"):
            x: int

    with pytest.raises(ConfigurationError, match="invalid message type name"):

        class Bad(Message, type_name="has space"):
            x: int


async def test_send_refuses_bad_arguments() -> None:
    async with memory_bus(max_message_bytes=1000) as bus:
        with pytest.raises(MessageTooLarge, match="over the limit of 1000"):
            await bus.send(Event(name="x" * 2000), to="billing")
        with pytest.raises(ValueError, match="timezone-aware"):
            import datetime

            await bus.send(Ping(n=1), to="billing", deliver_at=datetime.datetime(2030, 1, 1))
        with pytest.raises(ValueError, match="delay"):
            await bus.send(Ping(n=1), to="billing", delay=-1)
        with pytest.raises(TypeError, match=r"nmbus\.Message"):
            await bus.send({"n": 1}, to="billing")  # type: ignore[arg-type]
        with pytest.raises(InvalidQueueName):
            await bus.send(Ping(n=1), to='x"; DROP')


async def test_the_worker_runs_on_the_memory_store() -> None:
    store = MemoryStore()
    bus = Bus("billing", store=store, poll_interval=0.05, max_attempts=2, retry_delay=0)
    seen: list[tuple[str, int]] = []

    @bus.handler
    async def on_event(msg: Event, ctx: Context) -> None:
        seen.append((type(msg).__name__, ctx.retry_count))
        if isinstance(msg, OrderPlaced) and msg.order_id == 2:
            raise PermanentError("bad order")
        if isinstance(msg, OrderPlaced) and msg.order_id == 3 and ctx.retry_count == 1:
            raise RuntimeError("flaky")
        await ctx.send(Pong(n=1), to="audit")

    async with bus:
        for order in (1, 2, 3):
            await bus.send(OrderPlaced(name="o", order_id=order), to="billing")
        await drain(bus)
    states = [(r.subqueue, r.retry_count) for r in store.rows("billing")]
    assert states == [("X", 1), ("F", 1), ("X", 2)]
    assert len(store.rows("audit")) == 2  # the failed attempts sent nothing
    assert seen.count(("OrderPlaced", 1)) == 3


async def test_a_worker_is_built_alone_and_a_burst_drains_and_counts() -> None:
    # No Bus: the worker takes its collaborators, and a burst is its testing primitive.
    from nmbus.consume.dispatch import Dispatcher
    from nmbus.consume.worker import Worker
    from nmbus.envelopes import EnvelopeBuilder
    from nmbus.handlers import Registry
    from nmbus.settings import Settings

    store = MemoryStore()
    await store.ensure_queue("billing")
    builder = EnvelopeBuilder(max_message_bytes=1024)
    await store.insert("billing", "test", [builder.build(Ping(n=n), NO_OPTIONS) for n in range(7)])
    registry = Registry()
    seen: list[int] = []

    async def handle(msg: Ping, ctx: Context) -> None:
        seen.append(msg.n)
        if msg.n == 3:
            raise PermanentError("three is refused")
        if msg.n == 5:
            raise ValueError("five fails once")
        await ctx.send(Pong(n=msg.n), to="audit")

    registry.add(handle)
    settings = Settings(batch_size=2)
    worker = Worker(
        queue="billing",
        store=store,
        dispatcher=Dispatcher("billing", registry, RetryPolicy(max_attempts=3), settings, builder),
        settings=settings,
        client_id="burst",
    )
    assert await worker.run_burst() == {"X": 5, "R": 1, "F": 1}
    assert sorted(seen) == list(range(7))
    assert [r.subqueue for r in store.rows("billing")] == ["X", "X", "X", "F", "X", "R", "X"]
    assert len(store.rows("audit")) == 5  # the sends of the handlers that succeeded
    assert await worker.run_burst() == {"X": 0, "R": 0, "F": 0}  # R waits for its time


async def test_the_burst_example_of_the_handlers_page_runs() -> None:
    bus = Bus("billing", store=MemoryStore(), concurrency=0)

    @bus.handler
    async def charge(msg: OrderPlaced, ctx: Context) -> None:
        pass

    await bus.store.open()
    await bus.store.ensure_queue("billing")
    await bus.send(OrderPlaced(order_id=1, name="x"), to="billing")
    assert await bus.worker.run_burst() == {"X": 1, "R": 0, "F": 0}


async def test_request_reply_runs_on_the_memory_store() -> None:
    store = MemoryStore()
    pricing = Bus("pricing", store=store, poll_interval=0.05)
    shop = Bus("shop", store=store, poll_interval=0.05)

    @pricing.handler
    async def quote(msg: Ping, ctx: Context) -> None:
        await ctx.reply(Pong(n=msg.n * 2))

    async with pricing, shop:
        replies = await asyncio.gather(
            *(shop.request(Ping(n=n), to="pricing", timeout=5.0) for n in range(5))
        )
    assert replies == [Pong(n=n * 2) for n in range(5)]
