"""The tracer that sending and handling go through: OpenTelemetry's, or one that does nothing.

:mod:`nmbus.telemetry.tracing` records spans with OpenTelemetry (extra ``nmbus[otel]``)
and imports it at once, so the Bus imports that module only through
:func:`load`, once, and holds None when the API is not installed. Whoever
sends or handles asks :func:`tracer_of` for the tracer to use now: the bus's
:class:`~nmbus.telemetry.tracing.Tracing` while spans are recorded, else
:data:`NULL_TRACER`, which has the same interface and does nothing. There is
one path, traced or not::

    with tracer_of(tracing).producing("send", to) as producer:
        envelope = build(..., producer.headers(headers), ...)
        producer.sent(envelope)
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from nmbus.errors import ConfigurationError

if TYPE_CHECKING:
    from nmbus.messages import Envelope
    from nmbus.received import Received
    from nmbus.telemetry.tracing import Tracing


class ProducerSpan(Protocol):
    """The span of one send or publish, as the sender sees it."""

    def headers(self, given: Mapping[str, str] | None) -> Mapping[str, str] | None:
        """The headers to send: ``given`` with the span's trace context, if any."""
        ...

    def sent(self, envelope: Envelope) -> None: ...


class ConsumerSpan(Protocol):
    """The span of one handled message, current while its handlers run."""

    def end(self, error: BaseException | None = None, replayed: bool = False) -> None: ...


class Tracer(Protocol):
    def producing(
        self, operation: str, destination: str, batch: int | None = None
    ) -> AbstractContextManager[ProducerSpan]: ...

    def consuming(self, queue: str, received: Received) -> ConsumerSpan: ...


class _NoSpan:
    """Every span of the null tracer: a producer that adds nothing, a consumer that ends."""

    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def headers(self, given: Mapping[str, str] | None) -> Mapping[str, str] | None:
        return given

    def sent(self, envelope: Envelope) -> None:
        return None

    def end(self, error: BaseException | None = None, replayed: bool = False) -> None:
        return None


_NO_SPAN = _NoSpan()


class NullTracer:
    """Traces nothing: what sends and handling go through while no span is recorded."""

    __slots__ = ()

    def producing(self, operation: str, destination: str, batch: int | None = None) -> _NoSpan:
        return _NO_SPAN

    def consuming(self, queue: str, received: Received) -> _NoSpan:
        return _NO_SPAN

    def __repr__(self) -> str:
        return "NULL_TRACER"


NULL_TRACER = NullTracer()


def tracer_of(tracing: Tracing | None) -> Tracer:
    """The tracer to use now: ``tracing`` while it records spans, else the null one.

    A global tracer provider can be set at any time, and looking for one costs
    OpenTelemetry an environment lookup: ask once per send, or once per batch.
    """
    if tracing is not None and tracing.on():
        return tracing
    return NULL_TRACER


def load(provider: Any) -> Tracing | None:
    """Spans when opentelemetry-api is installed: imported once here, else None for good."""
    try:
        from nmbus.telemetry.tracing import Tracing
    except ImportError as exc:
        if not (exc.name or "").startswith("opentelemetry"):
            raise
        if provider is not None:
            raise ConfigurationError(
                "tracer_provider is given but opentelemetry-api is not installed: "
                "pip install 'nmbus[otel]'"
            ) from exc
        return None
    return Tracing(provider)
