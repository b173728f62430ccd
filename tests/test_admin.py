"""The operations layer against a real database: every method, and reads that never write."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import asyncpg
import pytest

from nmbus.errors import (
    ConfigurationError,
    InvalidQueueName,
    QueueNotFound,
    StoreError,
)
from nmbus.ops.admin import (
    Admin,
    FailedMessage,
    QueueStatus,
    RetentionDue,
    RetentionPolicy,
    Subscription,
    schema_ddl,
)
from nmbus.postgres.sql import render
from nmbus.settings import Settings
from tests.ops_data import CHARGE_ERROR, Facts, count, notifications, split_segments
from tests.waits import wait_until

OLD = RetentionPolicy(max_age=timedelta(hours=12))


@pytest.fixture
async def admin(dsn: str) -> AsyncIterator[Admin]:
    async with Admin.from_settings(Settings(dsn=dsn)) as opened:
        yield opened


# -- reads -------------------------------------------------------------------------------


async def test_queue_status(admin: Admin, facts: Facts) -> None:
    billing, shipping = await admin.queue_status()
    assert isinstance(billing, QueueStatus)
    assert (billing.queue, shipping.queue) == ("billing", "shipping")
    assert (billing.ready, billing.scheduled, billing.processed, billing.failed) == (6, 3, 165, 3)
    assert billing.in_flight == 2
    assert billing.oldest_ready_seconds is not None
    assert 1800 <= billing.oldest_ready_seconds < 1920
    assert billing.recent_processed == 100
    assert billing.recent_avg_ms == pytest.approx(50.5)
    assert billing.recent_p99_ms == pytest.approx(99.01)
    assert billing.recent_failed == 0  # failed 30+ minutes ago, window is 10 minutes
    assert (await admin.queue_status(window=3600))[0].recent_failed == 3
    assert shipping.ready == 1 and shipping.recent_avg_ms is None


async def test_cheap_status_estimates_x_on_big_tables_only(
    admin: Admin, facts: Facts, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    billing = (await admin.queue_status(exact=False))[0]
    exact = (await admin.queue_status(exact=True))[0]
    assert (billing.processed, billing.processed_estimated) == (165, False)  # a small table
    for field in ("ready", "scheduled", "failed", "in_flight", "recent_processed"):
        assert getattr(billing, field) == getattr(exact, field), field
    # Over the size limit X comes from the statistics system's live-row count.
    monkeypatch.setattr("nmbus.ops.admin.EXACT_COUNT_PAGES", 0)
    # The fixture's inserts reach the statistics system when their backend next
    # goes idle: flushed first, so they cannot land on top of what ANALYZE sets.
    await db.execute("SELECT pg_stat_force_next_flush()")
    await db.execute("SELECT 1")
    await db.execute("ANALYZE nmbus.billing")
    big = (await admin.queue_status())[0]
    assert big.processed_estimated and (big.ready, big.failed) == (6, 3)
    assert big.processed == 165  # ANALYZE of a small table counts every row


async def test_windows_give_throughput_percentiles_and_failure_rate(
    admin: Admin, facts: Facts
) -> None:
    billing = (await admin.queue_status(300, windows=[3600]))[0]
    five, hour = billing.windows
    assert (five.seconds, five.processed, five.failed, five.sampled) == (300, 100, 0, False)
    assert five.per_second == pytest.approx(100 / 300)
    assert five.p50_ms == pytest.approx(50.5) and five.p95_ms == pytest.approx(95.05)
    assert five.p99_ms == pytest.approx(99.01) and five.failure_rate == 0
    assert (hour.processed, hour.failed) == (100, 3)
    assert hour.failure_rate == pytest.approx(3 / 103)
    with pytest.raises(ConfigurationError):
        await admin.queue_status(0)


async def test_a_window_past_its_row_cap_is_sampled(
    admin: Admin, facts: Facts, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("nmbus.ops.admin.WINDOW_ROWS", 40)
    five = (await admin.queue_status(300))[0].windows[0]
    assert (five.processed, five.sampled) == (40, True)
    # The 40 rows read all went to X two minutes ago: the rate is over their span.
    assert five.per_second > 40 / 300


async def test_a_sampled_window_counts_failures_over_the_span_it_read(
    admin: Admin, facts: Facts, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ops_data: 100 X rows two minutes ago, 3 F rows 30-50 minutes ago. Capped at
    # 40 rows, the hour's X figures stop two minutes back; F rows older than that
    # are outside the span the rate describes and must not inflate the failure rate.
    monkeypatch.setattr("nmbus.ops.admin.WINDOW_ROWS", 40)
    hour = (await admin.queue_status(300, windows=[3600]))[0].windows[1]
    assert (hour.processed, hour.sampled, hour.failed) == (40, True, 0)
    assert hour.failure_rate == 0
    monkeypatch.setattr("nmbus.ops.admin.WINDOW_ROWS", 1000)
    hour = (await admin.queue_status(300, windows=[3600]))[0].windows[1]
    assert (hour.processed, hour.sampled, hour.failed) == (100, False, 3)


async def test_status_counts_sagas_where_an_endpoint_has_them(
    admin: Admin, facts: Facts, db: asyncpg.Connection
) -> None:
    await db.execute(render("create_saga_table", "nmbus", "billing"))
    await db.execute(
        'INSERT INTO nmbus."billing$saga" (saga_type, saga_key, state) '
        "VALUES ('Fulfilment', '1', '{}'), ('Fulfilment', '2', '{}')"
    )
    billing, shipping = await admin.queue_status()
    assert (billing.sagas, billing.sagas_estimated) == (2, False)
    assert shipping.sagas is None


async def test_queue_history_buckets(admin: Admin, facts: Facts) -> None:
    history = await admin.queue_history("billing", bucket_seconds=60, buckets=60)
    assert len(history) == 60
    assert [b.start for b in history] == sorted(b.start for b in history)
    assert sum(b.processed for b in history) == 100
    assert sum(b.failed for b in history) == 3
    busy = next(b for b in history if b.processed)
    assert busy.p99_ms == pytest.approx(99.01)
    capped = await admin.queue_history("billing", bucket_seconds=60, buckets=60, cap=7)
    assert sum(b.processed for b in capped) == 7
    with pytest.raises(QueueNotFound):
        await admin.queue_history("nosuch")


async def test_failed_page_filters_and_pages(admin: Admin, facts: Facts) -> None:
    page = await admin.failed_page(limit=2)
    assert [m.id for m in page.messages] == facts.failed_ids[::-1][:2]  # newest first
    assert page.next_cursor is not None
    rest = await admin.failed_page(cursor=page.next_cursor, limit=2)
    assert [m.id for m in rest.messages] == [facts.failed_ids[0]] and rest.next_cursor is None
    declined = await admin.failed_page("billing", error_contains="CARD DECLINED")
    assert [m.id for m in declined.messages] == [facts.failed_ids[2], facts.failed_ids[0]]
    refunds = await admin.failed_page(message_type="billing.Refund")
    assert [m.label for m in refunds.messages] == ["billing.Refund"]
    assert (await admin.failed_page(error_contains="%")).messages == ()  # plain text, no LIKE
    assert await admin.count_failed("billing", error_contains="declined") == 2
    with pytest.raises(ConfigurationError, match="cursor"):
        await admin.failed_page(cursor="billing:x")


async def test_requeue_and_purge_by_error_text(
    admin: Admin, facts: Facts, db: asyncpg.Connection
) -> None:
    assert await admin.requeue_failed("billing", error_contains="Card Declined") == 2
    assert await count(db, "subqueue = 'F'") == 1
    assert await admin.purge_failed("billing", error_contains="nothing like it") == 0
    assert await admin.purge_failed("billing", error_contains="refund_id") == 1
    assert await count(db, "subqueue = 'F'") == 0


async def test_list_queues(admin: Admin, facts: Facts) -> None:
    assert await admin.list_queues() == ["billing", "shipping"]
    assert await admin.schema_exists()


async def test_rows_estimate_counts_without_a_scan(
    admin: Admin, facts: Facts, db: asyncpg.Connection
) -> None:
    # The statistics system's counts reach the shared figures once the writing
    # session flushes them: asked to, at once (PostgreSQL 15 on); else when it
    # has been idle a while, a race with the ten seconds below.
    exact = {q: await count(db, "true", q) for q in ("billing", "shipping")}
    if await db.fetchval("SELECT current_setting('server_version_num')::int >= 150000"):
        await db.execute("SELECT pg_stat_force_next_flush()")
    await wait_until(
        admin.rows_estimate,
        until=lambda rows: rows == sum(exact.values()),
        timeout=10,
        interval=0.2,
    )
    assert await admin.rows_estimate(["shipping"]) == exact["shipping"]
    with pytest.raises(QueueNotFound):
        await admin.rows_estimate(["nowhere"])


async def test_failed_messages(admin: Admin, facts: Facts) -> None:
    found = await admin.failed_messages()
    assert [(m.queue, m.id) for m in found] == [("billing", i) for i in facts.failed_ids]
    first = found[0]
    assert isinstance(first, FailedMessage)
    assert (first.label, first.retry_count, first.error) == (
        "billing.Charge",
        5,
        "ValueError: card declined",
    )
    refunds = await admin.failed_messages("billing", message_type="billing.Refund")
    assert [m.label for m in refunds] == ["billing.Refund"]
    assert len(await admin.failed_messages("billing", limit=1)) == 1
    assert await admin.failed_messages("shipping") == []
    with pytest.raises(QueueNotFound, match="no queue 'nosuch' in schema 'nmbus'"):
        await admin.failed_messages("nosuch")
    with pytest.raises(InvalidQueueName):
        await admin.failed_messages("bad name!")


async def test_message(admin: Admin, facts: Facts) -> None:
    row = await admin.message("billing", facts.failed_ids[0])
    assert row is not None
    assert (row.subqueue, row.error_info, row.msg_headers) == (
        "F",
        CHARGE_ERROR,
        '{"tenant": "acme"}',
    )
    assert (row.from_endpoint, row.to_endpoint, row.label) == (
        "orders",
        "billing",
        "billing.Charge",
    )
    assert (await admin.message("billing", 1)) is not None  # any subqueue: this one is X
    assert await admin.message("billing", 999999) is None
    with pytest.raises(QueueNotFound):
        await admin.message("nosuch", 1)


async def test_count_failed(admin: Admin, facts: Facts) -> None:
    assert await admin.count_failed("billing") == 3
    assert await admin.count_failed("billing", message_type="billing.Charge") == 2
    assert await admin.count_failed("billing", ids=[facts.failed_ids[0], 1]) == 1
    assert await admin.count_failed("shipping") == 0


async def test_subscriptions(admin: Admin, facts: Facts) -> None:
    found = await admin.subscriptions()
    assert all(isinstance(s, Subscription) for s in found)
    assert [(s.publisher_endpoint, s.subscriber_endpoint, s.live) for s in found] == [
        ("orders", "billing", True),  # orders.OrderCancelled
        ("orders", "audit", False),  # orders.OrderPlaced, by subscriber
        ("orders", "billing", True),
        ("orders", "shipping", True),
        ("payments", "billing", True),
    ]
    live = await admin.subscriptions("orders", live_only=True)
    assert len(live) == 3 and all(s.live for s in live)
    assert [s.message_type for s in await admin.subscriptions("payments")] == ["payments.Refunded"]


async def test_retention_due(admin: Admin, facts: Facts, db: asyncpg.Connection) -> None:
    # Segments: the X rows older than 7 days, then those older than 12 hours, then the rest.
    await split_segments(db, "subqueue = 'X' AND last_processed < now() - interval '7 days'")
    await split_segments(db, "subqueue = 'X' AND last_processed < now() - interval '12 hours'")
    assert await admin.retention_due(OLD) == [
        RetentionDue("billing", processed=65, failed=0),
        RetentionDue("shipping", processed=0, failed=0),
    ]
    failed_too = RetentionPolicy(max_age=timedelta(days=7), failed_max_age=timedelta(minutes=35))
    assert await admin.retention_due(failed_too, ["billing"]) == [RetentionDue("billing", 5, 2)]
    with pytest.raises(QueueNotFound, match=r"no such queue\(s\): nosuch, other"):
        await admin.retention_due(OLD, ["billing", "nosuch", "other"])


# -- writes ------------------------------------------------------------------------------


async def test_requeue_failed(admin: Admin, facts: Facts, db: asyncpg.Connection, dsn: str) -> None:
    first, *rest = facts.failed_ids
    async with notifications(dsn) as notes:
        assert await admin.requeue_failed("billing", ids=[first]) == 1
        assert await asyncio.wait_for(notes.get(), 10) == "billing"  # the workers are woken
    row = await admin.message("billing", first)
    assert row is not None and row.retry_time > facts.now  # ready now
    assert (row.subqueue, row.retry_count, row.handling_client_id, row.lease_expires) == (
        "I",
        0,
        None,
        None,
    )
    assert row.error_info == CHARGE_ERROR  # kept as history until the next attempt
    assert await admin.requeue_failed("billing", ids=[first]) == 0  # not failed any more
    assert await admin.requeue_failed("billing", message_type="billing.Refund") == 1
    assert await admin.requeue_failed("billing", every=True) == 1
    assert await count(db, "subqueue = 'F'") == 0
    assert await count(db, "subqueue = 'I' AND retry_count = 0") == 4 + len(rest) + 1


async def test_purge_failed(admin: Admin, facts: Facts, db: asyncpg.Connection) -> None:
    assert await admin.purge_failed("billing", message_type="billing.Refund") == 1
    assert await count(db, "label = 'billing.Refund'") == 0
    assert await admin.purge_failed("billing", ids=[facts.failed_ids[0], 1]) == 1  # 1 is X
    assert await admin.purge_failed("billing", every=True) == 1
    assert await count(db, "subqueue = 'F'") == 0
    assert await count(db, "true") == 165 + 9  # nothing else was touched


@pytest.mark.parametrize("write", ["requeue_failed", "purge_failed"])
async def test_failed_writes_say_which_messages(admin: Admin, facts: Facts, write: str) -> None:
    change = getattr(admin, write)
    with pytest.raises(ConfigurationError, match="say which failed messages"):
        await change("billing")
    with pytest.raises(ConfigurationError):
        await change("billing", ids=[1], every=True)
    with pytest.raises(QueueNotFound):
        await change("nosuch", every=True)
    assert await admin.count_failed("billing") == 3


async def test_failed_writes_go_in_batches(admin: Admin, db: asyncpg.Connection) -> None:
    await admin.create_queues(["bulk"])
    await db.execute(
        "INSERT INTO nmbus.bulk (from_endpoint, to_endpoint, subqueue, retry_count, unique_id,"
        " error_info) SELECT 'a', 'bulk', 'F', 5, 'u' || g, 'E: x' FROM generate_series(1, 2500) g"
    )
    batches: list[tuple[str, int]] = []
    moved = await admin.requeue_failed(
        "bulk", every=True, on_batch=lambda q, n: batches.append((q, n))
    )
    assert moved == 2500 and batches == [("bulk", 1000), ("bulk", 1000), ("bulk", 500)]
    assert await count(db, "subqueue = 'I' AND retry_count = 0", "bulk") == 2500
    await db.execute("UPDATE nmbus.bulk SET subqueue = 'F'")
    batches.clear()
    gone = await admin.purge_failed(
        "bulk", every=True, on_batch=lambda q, n: batches.append((q, n))
    )
    assert gone == 2500 and [n for _, n in batches] == [1000, 1000, 500]


async def test_run_retention(
    admin: Admin, facts: Facts, db: asyncpg.Connection, tmp_path: Path
) -> None:
    # The 65 old X rows in a segment of their own; the rest in the next one.
    await split_segments(db, "subqueue = 'X' AND last_processed < now() - interval '12 hours'")
    policy = RetentionPolicy(max_age=timedelta(hours=12), batch_size=10, archive_dir=tmp_path)
    batches: list[int] = []
    (result,) = await admin.run_retention(policy, ["billing"], lambda _q, n: batches.append(n))
    assert result.queue == "billing" and result.deleted == {"X": 65, "F": 0}
    assert result.batches == 1 and batches == [65]  # one segment, dropped whole
    assert all(f.is_relative_to(tmp_path / "queue=billing") for f in result.files)
    assert await count(db, "subqueue = 'X'") == 100
    everything = RetentionPolicy(max_age=timedelta(0), failed_max_age=timedelta(minutes=35))
    results = await admin.run_retention(everything)
    # The other segment keeps its 100 X rows: a live lease holds one of its rows.
    # The two F rows past 35 minutes go one by one.
    assert [(r.queue, r.deleted, r.segments_pinned) for r in results] == [
        ("billing", {"X": 0, "F": 2}, 1),
        ("shipping", {"X": 0, "F": 0}, 0),
    ]
    with pytest.raises(QueueNotFound, match=r"no such queue\(s\): nosuch"):
        await admin.run_retention(everything, ["nosuch"])


async def test_an_archive_that_cannot_be_written_is_a_file_error(
    admin: Admin, facts: Facts, db: asyncpg.Connection, tmp_path: Path
) -> None:
    await split_segments(db, "subqueue = 'X' AND last_processed < now() - interval '12 hours'")
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    policy = RetentionPolicy(max_age=timedelta(hours=12), archive_dir=blocked)
    with pytest.raises(OSError) as raised:
        await admin.run_retention(policy, ["billing"])
    assert not isinstance(raised.value, StoreError)  # not the database's fault
    assert await count(db, "subqueue = 'X'") == 165


async def test_create_and_drop_queues(admin: Admin, db: asyncpg.Connection) -> None:
    await admin.create_queues(["alpha", "beta"])
    await admin.create_queues(["alpha"])  # idempotent
    assert await admin.list_queues() == ["alpha", "beta"]
    with pytest.raises(InvalidQueueName):
        await admin.create_queues(["no good"])
    with pytest.raises(QueueNotFound, match=r"no such queue\(s\): gamma; nothing dropped"):
        await admin.drop_queues(["alpha", "gamma"])
    assert await admin.list_queues() == ["alpha", "beta"]
    assert await admin.drop_queues(["alpha"]) == ["alpha"]
    assert await admin.list_queues() == ["beta"]
    assert await db.fetchval("SELECT to_regclass('nmbus.alpha')") is None


async def test_a_queue_dropped_and_created_again_starts_empty_of_unique_ids(
    admin: Admin, dsn: str, db: asyncpg.Connection
) -> None:
    # The unique table outlived its queue: a send reusing a unique_id of the
    # dropped queue was taken for a duplicate and silently not stored.
    from nmbus import Bus
    from tests.messages import Ping

    await admin.create_queues(["alpha"])
    async with Bus("sender", dsn=dsn, concurrency=0) as bus:
        await bus.send(Ping(n=1), to="alpha", unique_id="u1")
        assert await admin.drop_queues(["alpha"]) == ["alpha"]
        left = "SELECT count(*) FROM pg_class WHERE relname LIKE 'alpha$%'"
        assert await db.fetchval(left) == 0
        await admin.create_queues(["alpha"])
        await bus.send(Ping(n=2), to="alpha", unique_id="u1")
    assert await db.fetchval("SELECT count(*) FROM nmbus.alpha WHERE unique_id = 'u1'") == 1


async def test_create_queues_installs_a_missing_schema(dsn: str, db: asyncpg.Connection) -> None:
    async with Admin(dsn, "nmbus_new") as admin:
        assert not await admin.schema_exists()
        await admin.create_queues(["billing"])
        assert await admin.schema_exists()
        assert await admin.list_queues() == ["billing"]


def test_schema_ddl() -> None:
    text = schema_ddl("ops", "orders")
    assert 'CREATE TABLE IF NOT EXISTS "ops"."orders"' in text
    assert text.startswith("-- The DDL nmbus runs") and text.endswith("COMMIT;\n")
    # Clean DDL for a reader: no comment about how nmbus's own sources are kept.
    comments = [line for line in text.splitlines() if "--" in line]
    assert len(comments) == 3, comments
    for developer_note in ("tests/", "queries.sql", "sql/schema.sql", "python -m", "generated"):
        assert developer_note not in text, developer_note
    with pytest.raises(InvalidQueueName):
        schema_ddl("ops", "no good")
