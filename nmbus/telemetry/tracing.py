"""OpenTelemetry spans and trace context in headers (extra ``nmbus[otel]``).

This module imports ``opentelemetry`` at once: the Bus imports it only through
:func:`nmbus.telemetry.tracer.load`, once, and holds None when the API is not installed.
Sending and handling go through :func:`nmbus.telemetry.tracer.tracer_of`, which hands
out this module's :class:`Tracing` while it records spans and the null tracer
(same interface, does nothing) otherwise: one code path, traced or not.

What it does (docs/tracing.md):

- ``send``, ``publish`` (of the Bus or of a handler's Context) run in a
  PRODUCER span, whose context is written into the message's headers by the
  W3C trace-context propagator (``traceparent``, ``tracestate``);
- handling a message is a CONSUMER span whose parent is the context read from
  those headers; it is the current span while the handlers run, so what they
  send is its child. The current span wins over the ``traceparent`` a handled
  message carries onto what its handler sends (DESIGN, section 8);
- a handler's failure is recorded on its span (exception event, status ERROR).

With the API but no SDK provider, :meth:`Tracing.on` is False and no span is
made at all: the null tracer is used.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from nmbus.errors import RetryLater

if TYPE_CHECKING:
    from nmbus.messages import Envelope
    from nmbus.received import Received

#: ``messaging.system`` of every span: the bus is the messaging system here;
#: PostgreSQL is its storage (a ``db.system`` in database spans, if any).
SYSTEM = "nmbus"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
RETRY_COUNT = "messaging.nmbus.retry_count"

_PROPAGATOR = TraceContextTextMapPropagator()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nmbus")
    except PackageNotFoundError:  # pragma: no cover - a source tree not installed
        return "0"


class Producer:
    """The PRODUCER span of one send or publish: puts its context into the headers."""

    __slots__ = ("span",)

    def __init__(self, span: Span) -> None:
        self.span = span

    def headers(self, given: Mapping[str, str] | None) -> dict[str, str]:
        """This span's trace context, with ``given`` (the caller's own headers) on top."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self.span))
        if given:
            carrier.update(given)
        return carrier

    def sent(self, envelope: Envelope) -> None:
        span = self.span
        if span.is_recording():
            span.set_attribute("messaging.message.id", envelope.unique_id)
            if envelope.correlation_id:
                span.set_attribute("messaging.message.conversation_id", envelope.correlation_id)


class Consumer:
    """The CONSUMER span of one handled message, current while its handlers run."""

    __slots__ = ("span", "token")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.token = otel_context.attach(trace.set_span_in_context(span))

    def end(self, error: BaseException | None = None, replayed: bool = False) -> None:
        """End the span: ``error`` the handler's failure; ``replayed``: its batch runs again.

        A message whose failure makes its batch run again has both: its failure
        stands (it is not run again), so its span is the one that shows it.
        """
        span = self.span
        try:
            if replayed and span.is_recording():
                span.add_event("nmbus.replay")
            if error is not None and span.is_recording():
                if isinstance(error, RetryLater):
                    # Not a failure (errors.py): the handler asked to be called later.
                    span.add_event("nmbus.retry_later", {"seconds": float(error.seconds)})
                else:
                    # A span must never fail a message: an exception whose __str__
                    # raises is still an ERROR span, with its type for a description.
                    with suppress(Exception):
                        span.record_exception(error)
                    span.set_status(Status(StatusCode.ERROR, _describe(error)))
        finally:
            otel_context.detach(self.token)
            span.end()


def _describe(error: BaseException) -> str:
    try:
        text = str(error)
    except Exception:
        text = ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class Tracing:
    """Spans of one endpoint, from ``provider`` (default: the global tracer provider).

    Until an SDK provider is set (``trace.set_tracer_provider``), :meth:`on` is
    False and nothing is traced: the API alone would only make no-op spans,
    at a few microseconds per message. Headers still travel as they are.
    """

    __slots__ = ("_tracer",)

    def __init__(self, provider: Any = None) -> None:
        self._tracer: trace.Tracer | None = None
        if provider is not None:
            self._tracer = provider.get_tracer("nmbus", _version())

    def on(self) -> bool:
        """Whether spans are recorded: a provider was given, or a global one is set now."""
        if self._tracer is not None:
            return True
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            return False
        # The global provider can be set only once: keep its tracer for good.
        self._tracer = provider.get_tracer("nmbus", _version())
        return True

    @property
    def tracer(self) -> trace.Tracer:
        assert self._tracer is not None, "nmbus.telemetry.tracer.tracer_of checks on() first"
        return self._tracer

    @contextmanager
    def producing(
        self, operation: str, destination: str, batch: int | None = None
    ) -> Iterator[Producer]:
        """A PRODUCER span around one send (``operation="send"``) or publish.

        ``destination`` is the queue sent to, or the type published. An
        exception inside is recorded on the span, which ends with it.
        """
        attributes: dict[str, str | int] = {
            "messaging.system": SYSTEM,
            "messaging.operation.type": "send",
            "messaging.operation.name": operation,
            "messaging.destination.name": destination,
        }
        if batch is not None:
            attributes["messaging.batch.message_count"] = batch
        span = self.tracer.start_span(
            f"{operation} {destination}", kind=SpanKind.PRODUCER, attributes=attributes
        )
        with trace.use_span(span, end_on_exit=True):
            yield Producer(span)

    def consuming(self, queue: str, received: Received) -> Consumer:
        """Start the CONSUMER span of a row, child of the context its headers carry."""
        row = received.row
        parent = None
        # Headers that name no trace context are not parsed for one.
        if received.mentions(TRACEPARENT):
            try:
                headers = received.headers
            except ValueError:
                headers = {}
            carrier = {
                name: value
                for name in (TRACEPARENT, TRACESTATE)
                if isinstance(value := headers.get(name), str)
            }
            parent = _PROPAGATOR.extract(carrier) if carrier else None
        attributes: dict[str, str | int] = {
            "messaging.system": SYSTEM,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": queue,
            "messaging.message.id": row.unique_id,
            RETRY_COUNT: row.retry_count,
            "messaging.nmbus.row_id": row.id,
            "messaging.nmbus.from_endpoint": row.from_endpoint,
        }
        if row.correlation_id:
            attributes["messaging.message.conversation_id"] = row.correlation_id
        if row.label:
            attributes["messaging.nmbus.message_type"] = row.label
        span = self.tracer.start_span(
            f"process {queue}", context=parent, kind=SpanKind.CONSUMER, attributes=attributes
        )
        return Consumer(span)
