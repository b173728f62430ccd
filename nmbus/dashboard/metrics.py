"""The dashboard's ``/metrics``: queue depths in the Prometheus text format.

Each scrape reads :meth:`nmbus.ops.admin.Admin.queue_depths` (no scan of the X
rows, and a few statements for all queues, not some for each one) and renders
it through ``prometheus_client`` in a registry of its own, so nothing leaks
into, or out of, the process's default registry.
The series are listed in docs/metrics.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nmbus.ops.admin import Admin, QueueDepth

SUBQUEUES = (("I", "ready"), ("R", "scheduled"), ("X", "processed"), ("F", "failed"))


class _Snapshot(Collector):
    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return iter(self._families)


def families(queues: Sequence[QueueDepth], took: float) -> list[Metric]:
    depth = GaugeMetricFamily(
        "nmbus_queue_messages",
        "Rows of a queue table per subqueue (I ready, R scheduled, X processed, F failed); "
        "X is estimated on big tables, see nmbus_queue_processed_estimated",
        labels=["queue", "subqueue"],
    )
    estimated = GaugeMetricFamily(
        "nmbus_queue_processed_estimated",
        "1 when the X count of the queue is an estimate (pg_stat_user_tables), 0 when exact",
        labels=["queue"],
    )
    in_flight = GaugeMetricFamily(
        "nmbus_queue_in_flight_messages",
        "I/R rows held by a worker's lease",
        labels=["queue"],
    )
    oldest = GaugeMetricFamily(
        "nmbus_queue_oldest_ready_age_seconds",
        "How long the oldest row ready to be claimed has waited (0 when none is waiting)",
        labels=["queue"],
    )
    blocked = GaugeMetricFamily(
        "nmbus_queue_blocked_sequences",
        "Ordered sequences held back by a member in F or R (at most 20 counted)",
        labels=["queue"],
    )
    for q in queues:
        for letter, field in SUBQUEUES:
            depth.add_metric([q.queue, letter], getattr(q, field))
        estimated.add_metric([q.queue], 1.0 if q.processed_estimated else 0.0)
        in_flight.add_metric([q.queue], q.in_flight)
        oldest.add_metric([q.queue], q.oldest_ready_seconds or 0.0)
        blocked.add_metric([q.queue], q.blocked)
    scrape = GaugeMetricFamily(
        "nmbus_dashboard_scrape_duration_seconds",
        "How long reading the queue figures for this scrape took",
        value=took,
    )
    return [depth, estimated, in_flight, oldest, blocked, scrape]


async def exposition(admin: Admin) -> bytes:
    """The text exposition of every queue's depths, read now."""
    started = time.perf_counter()
    queues = await admin.queue_depths()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(families(queues, time.perf_counter() - started)))
    return generate_latest(registry)
