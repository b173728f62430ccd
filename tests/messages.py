"""Message types shared by the tests and the worker processes they start."""

from __future__ import annotations

from nmbus import Message


class Ping(Message, type_name="test.Ping"):
    n: int


class Pong(Message, type_name="test.Pong"):
    n: int


class Event(Message, type_name="test.Event"):
    name: str


class OrderPlaced(Event, type_name="test.OrderPlaced"):
    order_id: int


class Crash(Message, type_name="test.Crash"):
    """Handled by a handler that kills its own process (tests/workers.py)."""

    n: int


class Slow(Message, type_name="test.Slow"):
    """In tests/workers.py its handler announces itself and then hangs."""

    n: int


class Posted(Message, type_name="test.Posted"):
    """A member of an ordered sequence (tests/test_sequences.py)."""

    seq: str
    n: int


class Hop1(Message, type_name="otel.Hop1"):
    """The first hop of a traced chain (tests/test_tracing.py)."""

    n: int


class Hop2(Message, type_name="otel.Hop2"):
    n: int
