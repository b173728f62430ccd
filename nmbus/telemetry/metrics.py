"""Worker metrics in the Prometheus format, served on ``/metrics`` (extra ``nmbus[metrics]``).

Built by the Bus only when ``metrics_port`` is set (and served by
:mod:`nmbus.telemetry.server`, beside the health probes); otherwise the worker holds
None and pays one ``is None`` check per batch and per message. Each Bus has a
registry of its own, so two buses in one process never share or clash over a
series; each serves it on its own port. The series (docs/metrics.md):

=====================================  =========  ===================================
``nmbus_messages_handled_total``       counter    outcomes committed as X, per queue, type
``nmbus_messages_failed_total``        counter    outcomes committed as F, per queue, type
``nmbus_messages_retried_total``       counter    failed attempts sent to R, per queue, type
``nmbus_handler_duration_seconds``     histogram  time in the handlers, per queue, type
``nmbus_batch_size``                   histogram  messages per committed batch, per queue
``nmbus_lease_renewals_total``         counter    leases renewed, per queue
``nmbus_lease_renewal_failures_total`` counter    renewal rounds that failed, per queue
``nmbus_flow_waits_total``             counter    loop waits for a limit's room, per queue
``nmbus_flow_wait_seconds_total``      counter    seconds loops waited for room, per queue
``nmbus_flow_held_back_messages``      gauge      ready messages a handler's limits hold
                                                  back, per queue, handler (every 5 s)
=====================================  =========  ===================================

Counts are taken after the batch's commit, so a batch that rolls back counts
nothing. ``type`` is the message's type name when this process defines it,
else ``(unknown)``: a label a sender made up cannot grow the series without bound.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from typing import TYPE_CHECKING, Any

from nmbus.errors import ConfigurationError
from nmbus.messages import lookup_type

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from nmbus.messages import StoredMessage
    from nmbus.ports.store import Outcomes

#: The ``type`` label of a message whose type this process does not define.
UNKNOWN_TYPE = "(unknown)"
BATCH_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0)
DURATION_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
INSTALL_HINT = "pip install 'nmbus[metrics]'"


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ConfigurationError(
            f"metrics_port is set but prometheus_client is not installed: {INSTALL_HINT}, "
            "or leave NMBUS_METRICS_PORT unset"
        ) from exc
    return prometheus_client


class _Series:
    """The numbers of one (queue, type), updated in place by the worker's thread alone."""

    __slots__ = ("buckets", "failed", "handled", "retried", "seconds")

    def __init__(self) -> None:
        self.handled = 0
        self.failed = 0
        self.retried = 0
        # Per bucket (not cumulative): DURATION_BUCKETS, then +Inf.
        self.buckets = [0] * (len(DURATION_BUCKETS) + 1)
        self.seconds = 0.0


class WorkerMetrics:
    """The metrics of one endpoint's worker, in a registry of its own.

    The worker adds to plain numbers (an attribute increment, a bisect for a
    duration): no lock and no prometheus_client call per message. The numbers
    become metric families only when scraped, in the server's thread; a new
    (queue, type) series is added under a lock that the scrape also takes.
    """

    def __init__(self, queue: str) -> None:
        self._client = _client()
        self.queue = queue
        self._lock = threading.Lock()
        self._by_label: dict[str | None, _Series] = {}
        self._by_type: dict[str, _Series] = {}
        self._batches = [0] * (len(BATCH_BUCKETS) + 1)
        self._batched = 0
        self.renewals = 0
        self.renewal_failures = 0
        self.flow_waits = 0
        self.flow_wait_seconds = 0.0
        self._held_back: dict[str, int] = {}
        self.registry = self._client.CollectorRegistry()
        self.registry.register(self)

    def __repr__(self) -> str:
        return f"<WorkerMetrics {self.queue!r}>"

    @property
    def app(self) -> Any:
        """The exposition of this registry as a WSGI application (served on ``/metrics``)."""
        return self._client.make_wsgi_app(self.registry)

    # -- recording (the worker's thread) -------------------------------------------------

    def series(self, label: str | None) -> _Series:
        found = self._by_label.get(label)
        if found is not None:
            return found
        name = label if label and lookup_type(label) is not None else UNKNOWN_TYPE
        shared = self._by_type.get(name)
        if shared is None:
            shared = _Series()
            with self._lock:
                self._by_type[name] = shared
        if name != UNKNOWN_TYPE:
            self._by_label[label] = shared
        return shared

    def handler_ran(self, label: str | None, seconds: float) -> None:
        series = self.series(label)
        series.buckets[bisect_left(DURATION_BUCKETS, seconds)] += 1
        series.seconds += seconds

    def committed(
        self,
        batch: Sequence[StoredMessage],
        outcomes: Outcomes,
        whole_batch: bool = True,
        size: int | None = None,
    ) -> None:
        """Count the outcomes of a batch that has just been committed.

        ``whole_batch``: observe the batch's size (``size``, else its outcomes),
        once per batch: False for the parts a batch commits before its last.
        """
        if whole_batch:
            size = len(outcomes) if size is None else size
            self._batches[bisect_left(BATCH_BUCKETS, size)] += 1
            self._batched += size
        labels = {m.id: m.label for m in batch}
        for id, subqueue, error in zip(
            outcomes.ids, outcomes.subqueue, outcomes.error_info, strict=True
        ):
            if subqueue == "X":
                self.series(labels.get(id)).handled += 1
            elif subqueue == "F":
                self.series(labels.get(id)).failed += 1
            elif subqueue == "R" and error is not None:
                # An R without error is a reply handed back to its requester: no attempt failed.
                self.series(labels.get(id)).retried += 1

    def leases_renewed(self, count: int) -> None:
        self.renewals += count

    def lease_renewal_failed(self) -> None:
        self.renewal_failures += 1

    def flow_waited(self, seconds: float) -> None:
        """A loop whose claim left limited messages waiting waited ``seconds`` for room."""
        self.flow_waits += 1
        self.flow_wait_seconds += seconds

    def held_back(self, by_handler: dict[str, int]) -> None:
        """What each limited handler's limits hold back now (flow_status)."""
        with self._lock:
            self._held_back = dict(by_handler)

    # -- scraping (the server's thread) --------------------------------------------------

    def collect(self) -> Iterator[Any]:
        """The metric families, built from the numbers as they are now (a registry collector)."""
        core = self._client.metrics_core
        queue = self.queue
        with self._lock:
            types = sorted(self._by_type.items())
        labels = ("queue", "type")
        for attribute, name, text in COUNTERS:
            family = core.CounterMetricFamily(name, text, labels=labels)
            for type_name, series in types:
                family.add_metric((queue, type_name), getattr(series, attribute))
            yield family
        duration = core.HistogramMetricFamily(
            "nmbus_handler_duration_seconds",
            "Time spent in a message's handlers, failed attempts included.",
            labels=labels,
        )
        for type_name, series in types:
            buckets = _cumulative(DURATION_BUCKETS, series.buckets)
            duration.add_metric((queue, type_name), buckets, series.seconds)
        yield duration
        batch = core.HistogramMetricFamily(
            "nmbus_batch_size", "Messages per committed batch.", labels=("queue",)
        )
        buckets = _cumulative(BATCH_BUCKETS, self._batches)
        batch.add_metric((queue,), buckets, float(self._batched))
        yield batch
        per_queue: tuple[tuple[float, str, str], ...] = (
            (self.renewals, "nmbus_lease_renewals", "Leases of in-flight messages renewed."),
            (self.renewal_failures, "nmbus_lease_renewal_failures", "Failed lease renewals."),
            (self.flow_waits, "nmbus_flow_waits", "Loop waits for a flow limit's room."),
            (self.flow_wait_seconds, "nmbus_flow_wait_seconds", "Seconds waited for room."),
        )
        for value, name, text in per_queue:
            family = core.CounterMetricFamily(name, text, labels=("queue",))
            family.add_metric((queue,), value)
            yield family
        held = core.GaugeMetricFamily(
            "nmbus_flow_held_back_messages",
            "Ready messages of a handler's types that its flow limits hold back.",
            labels=("queue", "handler"),
        )
        with self._lock:
            by_handler = sorted(self._held_back.items())
        for handler, count in by_handler:
            held.add_metric((queue, handler), count)
        yield held


COUNTERS = (
    ("handled", "nmbus_messages_handled", "Messages whose outcome was committed as X (processed)."),
    ("failed", "nmbus_messages_failed", "Messages whose outcome was committed as F (failed)."),
    (
        "retried",
        "nmbus_messages_retried",
        "Failed attempts (or RetryLater) whose message was scheduled again in R.",
    ),
)


def _cumulative(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[str, float]]:
    """Prometheus buckets (``le`` text, cumulative count) from per-bucket counts."""
    buckets: list[tuple[str, float]] = []
    total = 0
    for bound, count in zip((*bounds, math.inf), counts, strict=True):
        total += count
        buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), float(total)))
    return buckets
