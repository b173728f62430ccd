"""The operations port's contract, on PostgreSQL through Admin.over.

Rows are written through the storage port (insert, claim, finish); Admin then
reads and changes them through the operations port, which only PostgreSQL's
adapter implements (the in-memory store keeps no copy of the operations SQL).
tests/test_admin.py checks it further (estimates, read-only transactions,
history over hours of rows).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from nmbus.errors import ConfigurationError, InvalidQueueName, QueueNotFound
from nmbus.messages import Envelope
from nmbus.ops.admin import Admin
from nmbus.ports.operations import MessageRow, RetentionPolicy
from nmbus.ports.store import SCHEMA_VERSION, Outcomes, Store
from nmbus.postgres import PostgresStore
from nmbus.postgres.operations import PostgresOperations
from nmbus.postgres.segments import advance
from nmbus.rows import COLUMNS
from nmbus.testing import MemoryStore

TRACE = "ValueError: card declined\nTraceback (most recent call last):\n  ..."


@dataclass
class Both:
    """A store written through the storage port, and an Admin over its operations."""

    store: Store
    admin: Admin
    dsn: str | None = None

    async def close_segment(self, queue: str) -> None:
        """Start a new segment of ``queue``."""
        if self.dsn is not None:
            conn = await asyncpg.connect(self.dsn)
            try:
                await advance(conn, "nmbus", queue)
            finally:
                await conn.close()


@pytest.fixture
async def both(dsn: str) -> AsyncIterator[Both]:
    pg = PostgresStore(dsn)
    await pg.open()
    try:
        async with Admin.over(PostgresOperations(dsn)) as admin:
            yield Both(pg, admin, dsn)
    finally:
        await pg.close()


def envelope(
    n: int,
    label: str = "shop.Charge",
    *,
    priority: int = 0,
    sequence: str | None = None,
    expires_at: datetime | None = None,
) -> Envelope:
    uid = uuid.uuid4().hex
    headers = json.dumps({"n": str(n)})
    return Envelope(label, f'{{"n":{n}}}', headers, uid, f"c-{n}", None, priority, sequence,
                    expires_at)  # fmt: skip


async def settle(
    store: Store, queue: str, fates: list[str | None], client: str = "c1"
) -> list[int]:
    """Claim as many rows as ``fates`` names and finish each so: X, F, R (in a minute),
    or None to leave it held. Returns their ids, in claim order."""
    async with store.worker_session() as session:
        rows = await session.claim(queue, len(fates), client, 30.0)
    outcomes = Outcomes()
    for row, fate in zip(rows, fates, strict=True):
        if fate == "F":
            outcomes.add(row.id, "F", error_info=TRACE)
        elif fate == "R":
            outcomes.add(row.id, "R", delay=60.0, error_info="TimeoutError: later")
        elif fate == "X":
            outcomes.add(row.id, "X")
    if len(outcomes):
        async with store.worker_session() as session, session.batch() as tx:
            await tx.finish(queue, outcomes, client)
    return [r.id for r in rows]


async def test_queues_are_created_listed_and_dropped(both: Both) -> None:
    admin = both.admin
    assert await admin.schema_exists()
    assert await admin.schema_version() == SCHEMA_VERSION
    await admin.create_queues(["alpha", "beta"])
    assert await admin.list_queues() == ["alpha", "beta"]
    with pytest.raises(InvalidQueueName):
        await admin.create_queues(["bad name!"])
    with pytest.raises(QueueNotFound, match="nosuch; nothing dropped"):
        await admin.drop_queues(["alpha", "nosuch"])
    assert await admin.list_queues() == ["alpha", "beta"]
    assert await admin.drop_queues(["alpha"]) == ["alpha"]
    assert await admin.list_queues() == ["beta"]


async def test_status_and_depths_count_every_subqueue(both: Both) -> None:
    store, admin = both.store, both.admin
    await store.insert("billing", "shop", [envelope(n) for n in range(7)])
    await store.insert("shipping", "shop", [envelope(9)])
    await settle(store, "billing", ["X", "X", "F", "R", None])
    billing, shipping = await admin.queue_status(300, windows=[3600])
    assert (billing.queue, shipping.queue) == ("billing", "shipping")
    figures = (billing.ready, billing.scheduled, billing.processed, billing.failed)
    assert figures == (3, 1, 2, 1) and billing.in_flight == 1
    assert billing.oldest_ready_seconds is not None and billing.oldest_ready_seconds >= 0
    assert (billing.recent_processed, billing.recent_failed) == (2, 1)
    assert billing.recent_avg_ms is not None and billing.recent_avg_ms >= 0
    five, hour = billing.windows
    assert (five.seconds, five.processed, five.failed, five.sampled) == (300, 2, 1, False)
    assert hour.failure_rate == pytest.approx(1 / 3)
    assert (shipping.ready, shipping.processed, shipping.recent_avg_ms) == (1, 0, None)
    exact = (await admin.queue_status(exact=True, queues=["billing"]))[0]
    assert (exact.processed, exact.failed, exact.recent_processed) == (2, 1, 2)
    detail = await admin.queue_detail("billing", windows=[60])
    assert (detail.ready, detail.failed, len(detail.windows)) == (3, 1, 1)
    depths = {d.queue: d for d in await admin.queue_depths()}
    depth = depths["billing"]
    assert (depth.ready, depth.scheduled, depth.processed, depth.failed) == (3, 1, 2, 1)
    assert (depth.in_flight, depth.blocked) == (1, 0)
    assert await admin.rows_estimate(["shipping"]) >= 0
    with pytest.raises(QueueNotFound, match="no such queue"):
        await admin.queue_status(queues=["nosuch"])
    with pytest.raises(QueueNotFound, match="no queue 'nosuch'"):
        await admin.queue_detail("nosuch")


async def test_segments_hold_every_row_and_count_what_is_pending(both: Both) -> None:
    """Whatever a store's queue table is (one plain table, or partitions), its segments hold
    every row, oldest first, and count its rows not in X exactly."""
    store, admin = both.store, both.admin
    await store.insert("billing", "shop", [envelope(n) for n in range(6)])
    await store.insert("shipping", "shop", [envelope(9)])
    await settle(store, "billing", ["X", "X", "F", "R"])
    found = await admin.queue_segments()
    assert [s.queue for s in found] == sorted(s.queue for s in found)
    billing = [s for s in found if s.queue == "billing"]
    assert billing and [s.number for s in billing] == sorted({s.number for s in billing})
    assert sum(s.pending for s in billing) == 4  # 2 in I, 1 in R, 1 in F
    holding = [s for s in billing if s.oldest is not None]
    first = await admin.message("billing", min(r.id for r in await _rows(admin, "billing")))
    last = await admin.message("billing", max(r.id for r in await _rows(admin, "billing")))
    assert first is not None and last is not None
    assert (holding[0].oldest, holding[-1].newest) == (first.insert_time, last.insert_time)
    assert all(s.rows >= 0 and s.size_bytes >= 0 for s in found)
    shipping = await admin.queue_segments(["shipping"])  # one, or one and the next
    assert {s.queue for s in shipping} == {"shipping"}
    assert sum(s.pending for s in shipping) == 1
    with pytest.raises(QueueNotFound, match="no such queue"):
        await admin.queue_segments(["nosuch"])
    with pytest.raises(InvalidQueueName):
        await admin.queue_segments(["bad name!"])


async def _rows(admin: Admin, queue: str) -> list[MessageRow]:
    """Every row of ``queue``, through the operations port (ids are small and dense here)."""
    found = []
    for ident in range(1, 20):
        if (got := await admin.message(queue, ident)) is not None:
            found.append(got)
    return found


async def test_a_failed_head_blocks_its_sequence(both: Both) -> None:
    store, admin = both.store, both.admin
    await store.insert("q", "shop", [envelope(n, sequence="acct-1") for n in range(3)])
    await settle(store, "q", ["F"])
    (status,) = await admin.queue_status()
    (blocked,) = status.blocked
    assert (blocked.sequence_key, blocked.subqueue, blocked.waiting) == ("acct-1", "F", 2)
    assert blocked.error == "ValueError: card declined" and blocked.attempts == 1
    assert status.ready == 2 and status.ready_blocked
    assert (await admin.queue_depths())[0].blocked == 1


async def test_history_buckets_hold_what_was_finished(both: Both) -> None:
    store, admin = both.store, both.admin
    await store.insert("q", "shop", [envelope(n) for n in range(4)])
    await settle(store, "q", ["X", "X", "X", "F"])
    history = await admin.queue_history("q", bucket_seconds=3600, buckets=3)
    assert len(history) == 3
    assert [b.start for b in history] == sorted(b.start for b in history)
    assert sum(b.processed for b in history) == 3 and sum(b.failed for b in history) == 1
    last = history[-1]
    assert last.start <= datetime.now(UTC) < last.start + timedelta(hours=1)
    capped = await admin.queue_history("q", bucket_seconds=3600, buckets=2, cap=2)
    assert sum(b.processed for b in capped) <= 2 * 2
    with pytest.raises(QueueNotFound):
        await admin.queue_history("nosuch")


async def test_failed_messages_are_listed_paged_and_counted(both: Both) -> None:
    store, admin = both.store, both.admin
    await store.insert("a", "shop", [envelope(n) for n in range(3)])
    await store.insert("b", "shop", [envelope(10, "shop.Refund"), envelope(11)])
    failed_a = await settle(store, "a", ["F", "F", "X"])
    failed_b = await settle(store, "b", ["F", "F"])
    listed = await admin.failed_messages()
    assert [(m.queue, m.id) for m in listed] == [("a", i) for i in failed_a[:2]] + [
        ("b", i) for i in failed_b
    ]
    assert listed[0].error == "ValueError: card declined" and listed[0].retry_count == 1
    only = await admin.failed_messages("b", message_type="shop.Refund")
    assert [m.label for m in only] == ["shop.Refund"]
    first = await admin.failed_page(limit=3, error_chars=10)
    assert [(m.queue, m.id) for m in first.messages] == [
        ("a", failed_a[1]),
        ("a", failed_a[0]),
        ("b", failed_b[1]),
    ]
    assert first.messages[0].error == "ValueError" and first.messages[0].error_cut
    assert first.next_cursor == f"b:{failed_b[1]}"
    rest = await admin.failed_page(cursor=first.next_cursor, limit=3)
    assert [(m.queue, m.id) for m in rest.messages] == [("b", failed_b[0])]
    assert rest.next_cursor is None and not rest.messages[0].error_cut
    found = await admin.failed_page(error_contains="CARD", queue="b")
    assert len(found.messages) == 2
    assert (await admin.failed_page(error_contains="no such text")).messages == ()
    counted = await admin.failed_count("a")
    assert (counted.count, counted.max_id) == (2, max(failed_a[:2]))
    assert await admin.count_failed("b", message_type="shop.Refund") == 1
    assert await admin.count_failed("b", ids=[failed_b[0]]) == 1
    none = await admin.failed_count("a", error_contains="nothing like it")
    assert (none.count, none.max_id) == (0, None)
    with pytest.raises(QueueNotFound):
        await admin.failed_messages("nosuch")


async def test_a_message_shows_every_column(both: Both) -> None:
    store, admin = both.store, both.admin
    expires = datetime.now(UTC) + timedelta(days=1)
    await store.insert("q", "shop", [envelope(1, priority=3, sequence="k", expires_at=expires)])
    (ident,) = await settle(store, "q", ["F"])
    row = await admin.message("q", ident)
    assert isinstance(row, MessageRow)
    assert tuple(f.name for f in fields(row))[: len(COLUMNS)] == COLUMNS
    assert (row.id, row.from_endpoint, row.to_endpoint, row.subqueue) == (ident, "shop", "q", "F")
    assert (row.priority, row.sequence_key, row.expires_at) == (3, "k", expires)
    assert (row.isolated, row.retry_count, row.label) == (False, 1, "shop.Charge")
    assert row.error_info == TRACE and row.error_info_chars == len(TRACE)
    assert json.loads(row.msg_headers or "") == {"n": "1"}
    assert row.msg_text == '{"n":1}' and row.correlation_id == "c-1"
    assert row.last_processed is not None and row.handling_client_id is None
    cut = await admin.message("q", ident, max_chars=5)
    assert cut is not None and (cut.error_info, cut.msg_text) == ("Value", '{"n":')
    assert (cut.error_info_chars, cut.msg_text_chars) == (len(TRACE), 7)
    assert await admin.message("q", ident + 1000) is None
    assert await admin.message_text("q", ident, "error") == TRACE
    assert await admin.message_text("q", ident, "body") == '{"n":1}'
    with pytest.raises(QueueNotFound, match="no message"):
        await admin.message_text("q", ident + 1000, "body")
    with pytest.raises(InvalidQueueName):
        await admin.message("bad name!", 1)


async def test_requeue_and_purge_act_on_what_they_are_told(both: Both) -> None:
    store, admin = both.store, both.admin
    await store.insert("q", "shop", [envelope(n) for n in range(5)])
    failed = await settle(store, "q", ["F", "F", "F", "F", "X"])
    failed = failed[:4]
    with pytest.raises(ConfigurationError, match="say which"):
        await admin.requeue_failed("q")
    assert await admin.requeue_failed("q", ids=[failed[0]]) == 1
    counted = await admin.failed_count("q", error_contains="declined")
    assert counted.count == 3
    batches: list[int] = []
    moved = await admin.requeue_failed(
        "q", error_contains="declined", counted=counted, on_batch=lambda _q, n: batches.append(n)
    )
    assert moved == 3 and batches == [3]
    status = (await admin.queue_status())[0]
    assert (status.ready, status.failed, status.processed) == (4, 0, 1)
    async with store.worker_session() as session:
        again = await session.claim("q", 10, "c2", 30.0)
    assert sorted(m.id for m in again) == sorted(failed) and {m.retry_count for m in again} == {1}
    await settle_held(store, again, "c2")
    assert await admin.purge_failed("q", ids=[failed[0]]) == 1
    assert await admin.purge_failed("q", every=True) == 3
    assert (await admin.queue_status())[0].failed == 0
    assert await admin.count_failed("q") == 0


async def settle_held(store: Store, rows: list, client: str) -> None:
    outcomes = Outcomes()
    for row in rows:
        outcomes.add(row.id, "F", error_info=TRACE)
    async with store.worker_session() as session, session.batch() as tx:
        await tx.finish("q", outcomes, client)


async def test_a_count_binds_a_change_to_the_rows_it_counted(both: Both) -> None:
    store, admin = both.store, both.admin
    await store.insert("q", "shop", [envelope(n) for n in range(2)])
    await settle(store, "q", ["F"])
    counted = await admin.failed_count("q")
    await settle(store, "q", ["F"])  # fails after the count
    assert await admin.purge_failed("q", every=True, counted=counted) == 1
    assert await admin.count_failed("q") == 1
    with pytest.raises(ConfigurationError, match="cannot bind"):
        await admin.purge_failed("other", every=True, counted=counted)


async def test_subscriptions_are_listed_live_or_expired(both: Both) -> None:
    store, admin = both.store, both.admin
    await store.subscribe("orders", "billing", ["shop.OrderPlaced"], ttl=None)
    await store.subscribe("orders", "audit", ["shop.OrderPlaced"], ttl=-1.0)
    await store.subscribe("stock", "billing", ["shop.Reserved"], ttl=60.0)
    found = await admin.subscriptions()
    assert [(s.publisher_endpoint, s.subscriber_endpoint, s.live) for s in found] == [
        ("orders", "audit", False),
        ("orders", "billing", True),
        ("stock", "billing", True),
    ]
    assert found[2].expiration_date is not None and found[0].created_date is not None
    assert [s.subscriber_endpoint for s in await admin.subscriptions("orders", live_only=True)] == [
        "billing"
    ]


async def test_retention_removes_old_rows_and_expired_ones_nobody_took(both: Both) -> None:
    store, admin = both.store, both.admin
    long_ago = datetime.now(UTC) - timedelta(hours=1)
    await store.insert("q", "shop", [envelope(n) for n in range(4)])
    await store.insert("q", "shop", [envelope(9, expires_at=long_ago)])
    await settle(store, "q", ["X", "X", "F"])
    await both.close_segment("q")  # on PostgreSQL, processed rows go with their segment
    now = RetentionPolicy(max_age=timedelta(0), batch_size=1)
    (due,) = await admin.retention_due(now)
    assert (due.queue, due.processed, due.failed) == ("q", 2, 0)
    batches: list[int] = []
    (result,) = await admin.run_retention(now, ["q"], lambda _q, n: batches.append(n))
    assert result.deleted == {"X": 3, "F": 0} and sum(batches) == 3
    status = (await admin.queue_status())[0]
    assert (status.ready, status.processed, status.failed) == (1, 0, 1)
    failed_too = RetentionPolicy(max_age=timedelta(0), failed_max_age=timedelta(0))
    assert (await admin.retention_due(failed_too))[0].failed == 1
    (result,) = await admin.run_retention(failed_too)
    assert result.deleted == {"X": 0, "F": 1} and result.total == 1
    with pytest.raises(QueueNotFound):
        await admin.run_retention(now, ["nosuch"])


async def test_without_a_route_nothing_waits_in_the_outbox(both: Both) -> None:
    admin = both.admin
    assert await admin.outbox_backlog() == []
    assert await admin.queues_created_by_send() == {}


# -- the in-memory store has no operations ------------------------------------------------


def test_operations_over_the_memory_store_are_refused_with_a_clear_error() -> None:
    with pytest.raises(ConfigurationError, match=r"MemoryStore has no operations: .*PostgreSQL"):
        Admin.over(MemoryStore())  # type: ignore[arg-type]
