"""Every `nmbus` command against a real database: exit codes, tables, --json, confirmations."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import structlog
from typer.testing import CliRunner, Result

from nmbus import Bus, Context
from nmbus.cli import app
from nmbus.cli._table import size_text
from nmbus.testing import drain
from tests.messages import Ping
from tests.ops_data import CHARGE_ERROR, Facts, count, notifications, split_segments
from tests.waits import wait_until

runner = CliRunner()


@pytest.fixture(autouse=True)
def _keep_logging_config() -> Iterator[None]:
    """The CLI configures structlog for the process; give other tests theirs back."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


class Cli:
    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    async def __call__(self, *args: str, dsn: bool = True, code: int = 0) -> Result:
        argv = [*args, "--dsn", self.dsn] if dsn else list(args)
        env = {"COLUMNS": "200", "NMBUS_DSN": None}
        result = await asyncio.to_thread(runner.invoke, app, argv, env=env)
        assert result.exit_code == code, (argv, result.stdout, result.stderr, result.exception)
        return result

    async def json(self, *args: str) -> Any:
        return json.loads((await self(*args, "--json")).stdout)


@pytest.fixture
def cli(dsn: str) -> Cli:
    return Cli(dsn)


async def test_status(cli: Cli, facts: Facts) -> None:
    got = await cli.json("status")
    billing, shipping = got["queues"]
    assert billing["queue"] == "billing" and shipping["queue"] == "shipping"
    assert {k: billing[k] for k in ("ready", "scheduled", "processed", "failed", "in_flight")} == {
        "ready": 6,
        "scheduled": 3,
        "processed": 165,
        "failed": 3,
        "in_flight": 2,
    }
    assert 1800 <= billing["oldest_ready_seconds"] < 1920
    assert billing["recent_processed"] == 100
    assert billing["recent_avg_ms"] == pytest.approx(50.5)
    assert billing["recent_p99_ms"] == pytest.approx(99.01)
    assert billing["recent_failed"] == 0  # failed 30+ minutes ago, window is 10
    hour = await cli.json("status", "--window", "3600")
    assert hour["queues"][0]["recent_failed"] == 3
    text = (await cli("status")).stdout
    assert "billing" in text and "shipping" in text and "165" in text
    assert re.search(r" 3[01]m(\d\ds)? ", text), text  # oldest ready: 30 minutes and seconds


async def test_status_marks_ready_rows_held_by_a_blocked_sequence(
    cli: Cli, dsn: str, db: asyncpg.Connection
) -> None:
    from nmbus import Bus
    from tests.messages import Posted

    async with Bus("ledger", dsn=dsn, concurrency=0) as bus:
        head = await bus.send(Posted(seq="acct", n=0), to="ledger", sequence="acct")
        await bus.send(Posted(seq="acct", n=1), to="ledger", sequence="acct")
    # The head failed for good: the member behind it is ready, but parked.
    await db.execute("UPDATE nmbus.ledger SET subqueue = 'F' WHERE unique_id = $1", head)
    (ledger,) = (await cli.json("status"))["queues"]
    assert (ledger["ready"], ledger["oldest_ready_seconds"]) == (1, None)
    assert [b["sequence_key"] for b in ledger["blocked"]] == ["acct"]
    row = next(line for line in (await cli("status")).stdout.splitlines() if "ledger" in line)
    assert "blocked" in row, row


async def test_status_estimates_x_on_big_tables_and_exact_counts_it(
    cli: Cli, facts: Facts, db: asyncpg.Connection
) -> None:
    # Past 16 MiB, X comes from the live-row count (here as ANALYZE's sample
    # left it), so it is only near the real figure; --exact counts it.
    await db.execute(
        "INSERT INTO nmbus.billing (from_endpoint, to_endpoint, subqueue, last_processed, "
        "msg_text) SELECT 'o', 'billing', 'X', now() - interval '2 days', repeat('x', 400) "
        "FROM generate_series(1, 40000)"
    )
    # The INSERT's own counts reach the statistics system when this backend next
    # goes idle: flushed first, so they cannot land on top of what ANALYZE sets.
    await db.execute("SELECT pg_stat_force_next_flush()")
    await db.execute("SELECT 1")
    await db.execute("ANALYZE nmbus.billing")
    estimated = (await cli.json("status"))["queues"][0]
    assert estimated["processed_estimated"] is True
    assert abs(estimated["processed"] - 40165) <= 40165 * 0.05
    exact = (await cli.json("status", "--exact"))["queues"][0]
    assert (exact["processed"], exact["processed_estimated"]) == (40165, False)
    assert f"~{estimated['processed']:,}" in (await cli("status")).stdout
    await cli("status", "--window", "0", code=2)


async def test_no_database_is_a_clear_error(cli: Cli) -> None:
    result = await cli("status", dsn=False, code=2)
    assert "NMBUS_DSN" in result.stderr
    bad = await cli("status", "--dsn", "postgresql://postgres@127.0.0.1:1/none", dsn=False, code=1)
    assert "error" in bad.stderr


async def test_failed_list_and_show(cli: Cli, facts: Facts) -> None:
    listed = await cli.json("failed", "list")
    assert [(r["queue"], r["id"]) for r in listed] == [("billing", i) for i in facts.failed_ids]
    assert listed[0]["error"] == "ValueError: card declined"
    only = await cli.json("failed", "list", "billing", "--type", "billing.Refund")
    assert [r["label"] for r in only] == ["billing.Refund"]
    text = (await cli("failed", "list")).stdout
    assert "ValueError: card declined" in text and "KeyError" in text
    shown = await cli.json("failed", "show", "billing", str(facts.failed_ids[0]))
    assert shown["error_info"] == CHARGE_ERROR and shown["subqueue"] == "F"
    assert json.loads(shown["msg_headers"]) == {"tenant": "acme"}
    text = (await cli("failed", "show", "billing", str(facts.failed_ids[0]))).stdout
    assert "Traceback (most recent call last)" in text
    missing = await cli("failed", "show", "billing", "999999", code=1)
    assert "no message 999999" in missing.stderr
    nowhere = await cli("failed", "list", "nosuchqueue", code=1)
    assert "no queue" in nowhere.stderr
    await cli("failed", "list", "bad name!", code=2)


async def test_failed_requeue(cli: Cli, facts: Facts, db: asyncpg.Connection, dsn: str) -> None:
    first, *rest = facts.failed_ids
    async with notifications(dsn) as notes:
        got = await cli.json("failed", "requeue", "billing", "--id", str(first))
        assert got == {"queue": "billing", "requeued": 1}
        assert await asyncio.wait_for(notes.get(), 10) == "billing"
    row = await db.fetchrow(
        "SELECT subqueue, retry_count, handling_client_id, lease_expires, now() - retry_time "
        "FROM nmbus.billing WHERE id = $1",
        first,
    )
    assert tuple(row)[:4] == ("I", 0, None, None) and row[4] < timedelta(minutes=1)
    # An id that is not failed any more: reported, exit 1.
    again = await cli("failed", "requeue", "billing", "--id", str(first), code=1)
    assert again.stderr.strip() == "error: 1 of the given ids is not a failed message of billing"
    two = await cli("failed", "requeue", "billing", "--id", str(first), "--id", "999999", code=1)
    assert "error: 2 of the given ids are not failed messages of billing" in two.stderr
    # Bulk requeue asks first; without a terminal and without --yes it refuses.
    refused = await cli("failed", "requeue", "billing", "--all", code=1)
    assert "--yes" in refused.stderr
    assert await count(db, "subqueue = 'F'") == 2
    await cli("failed", "requeue", "billing", code=2)  # no selection: usage error
    await cli("failed", "requeue", "billing", "--all", "--id", "1", code=2)
    text = (await cli("failed", "requeue", "billing", "--all", "--yes")).stdout
    assert "requeued 2" in text
    assert await count(db, f"id = ANY('{{{','.join(map(str, rest))}}}') AND subqueue = 'I'") == 2


async def test_failed_purge(cli: Cli, facts: Facts, db: asyncpg.Connection) -> None:
    refused = await cli("failed", "purge", "billing", "--type", "billing.Refund", code=1)
    assert "Refusing without --yes" in refused.stderr
    # The question names what it deletes, in words that agree with how many.
    one = await cli("failed", "purge", "billing", "--id", str(facts.failed_ids[0]), code=1)
    assert f"the failed message with id {facts.failed_ids[0]} in 'billing'" in one.stderr
    ids = [str(i) for i in facts.failed_ids[:2]]
    two = await cli("failed", "purge", "billing", "--id", ids[0], "--id", ids[1], code=1)
    assert f"failed messages with ids {ids[0]}, {ids[1]} in 'billing'" in two.stderr
    assert await count(db, "subqueue = 'F'") == 3
    got = await cli.json("failed", "purge", "billing", "--type", "billing.Refund", "--yes")
    assert got == {"queue": "billing", "purged": 1}
    assert await count(db, "label = 'billing.Refund'") == 0
    text = (await cli("failed", "purge", "billing", "--all", "--yes")).stdout
    assert "purged 2" in text
    assert await count(db, "subqueue = 'F'") == 0
    assert await count(db, "true") == 165 + 9  # nothing else was touched


@pytest.mark.parametrize("verb", ["purge", "requeue"])
async def test_failed_changes_only_what_it_counted(
    cli: Cli, facts: Facts, dsn: str, verb: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message that fails between the count (the question, the progress bar) and the
    change was changed without having been counted: what is confirmed is what is done."""
    from nmbus.ops.admin import Admin

    counting = Admin.failed_count
    late: list[int] = []

    async def then_one_more_fails(self: Admin, queue: str, **filters: Any) -> Any:
        found = await counting(self, queue, **filters)
        if not late:  # the first count: one more message fails right after it
            conn = await asyncpg.connect(dsn)
            try:
                late.append(
                    await conn.fetchval(
                        "INSERT INTO nmbus.billing (from_endpoint, to_endpoint, subqueue, "
                        "retry_count, last_processed, label, msg_text, error_info) VALUES "
                        "('orders', 'billing', 'F', 5, now(), 'billing.Charge', '{}', 'E: late') "
                        "RETURNING id"
                    )
                )
            finally:
                await conn.close()
        return found

    monkeypatch.setattr(Admin, "failed_count", then_one_more_fails)
    done = await cli("failed", verb, "billing", "--all", "--yes")
    assert f"{'purged' if verb == 'purge' else 'requeued'} 3 message(s)" in done.stdout
    assert "1 more matching message(s) failed after the count and were left" in done.stderr
    db = await asyncpg.connect(dsn)
    try:
        assert await db.fetchval("SELECT subqueue FROM nmbus.billing WHERE id = $1", late[0]) == "F"
        assert await count(db, "subqueue = 'F'") == 1
    finally:
        await db.close()


async def test_failed_requeue_in_batches(cli: Cli, db: asyncpg.Connection) -> None:
    await cli("queues", "create", "bulk")
    await db.execute(
        "INSERT INTO nmbus.bulk (from_endpoint, to_endpoint, subqueue, retry_count, unique_id,"
        " error_info) SELECT 'a', 'bulk', 'F', 5, 'u' || g, 'E: x' FROM generate_series(1, 2500) g"
    )
    got = await cli.json("failed", "requeue", "bulk", "--all", "--yes")
    assert got == {"queue": "bulk", "requeued": 2500}
    assert await count(db, "subqueue = 'I' AND retry_count = 0", "bulk") == 2500


async def test_queues(cli: Cli, db: asyncpg.Connection) -> None:
    assert await cli.json("queues", "create", "alpha", "beta") == {
        "created_or_present": ["alpha", "beta"]
    }
    assert await cli.json("queues", "list") == ["alpha", "beta"]
    assert "alpha" in (await cli("queues", "list")).stdout
    assert "ready: gamma" in (await cli("queues", "create", "gamma")).stdout
    refused = await cli("queues", "drop", "alpha", code=1)
    assert "--yes" in refused.stderr
    assert await cli.json("queues", "list") == ["alpha", "beta", "gamma"]
    assert await cli.json("queues", "drop", "alpha", "--yes") == {"dropped": ["alpha"]}
    assert "dropped: gamma" in (await cli("queues", "drop", "gamma", "--yes")).stdout
    assert await db.fetchval("SELECT to_regclass('nmbus.alpha')") is None
    missing = await cli("queues", "drop", "alpha", "--yes", code=1)
    assert "no such queue" in missing.stderr
    await cli("queues", "create", "no good", code=2)


async def test_subscriptions(cli: Cli, facts: Facts) -> None:
    got = await cli.json("subscriptions", "list")
    assert [(r["publisher_endpoint"], r["subscriber_endpoint"], r["live"]) for r in got] == [
        ("orders", "billing", True),  # orders.OrderCancelled
        ("orders", "audit", False),  # orders.OrderPlaced, by subscriber
        ("orders", "billing", True),
        ("orders", "shipping", True),
        ("payments", "billing", True),
    ]
    live = await cli.json("subscriptions", "list", "--live", "--publisher", "orders")
    assert len(live) == 3 and all(r["live"] for r in live)
    text = (await cli("subscriptions", "list")).stdout
    assert "payments.Refunded" in text and "expired" in text


async def test_cleanup(cli: Cli, facts: Facts, db: asyncpg.Connection, tmp_path: Path) -> None:
    await split_segments(db, "subqueue = 'X' AND last_processed < now() - interval '12 hours'")
    dry = await cli.json("cleanup", "--older-than", "12h", "--dry-run")
    assert dry["queues"] == {"billing": {"X": 65, "F": 0}, "shipping": {"X": 0, "F": 0}}
    assert "65" in (await cli("cleanup", "--older-than", "12h", "--dry-run")).stdout
    refused = await cli("cleanup", "--older-than", "12h", code=1)
    assert "--yes" in refused.stderr
    assert await count(db, "subqueue = 'X'") == 165
    got = await cli.json(
        "cleanup", "billing", "--older-than", "12h", "--batch-size", "10",
        "--archive-dir", str(tmp_path), "--yes",
    )  # fmt: skip
    (result,) = got["queues"]
    assert result["deleted_processed"] == 65 and result["deleted_failed"] == 0
    assert result["batches"] == 1 and result["segments_dropped"] == 1  # one segment, whole
    assert result["bytes_freed"] > 0
    assert len({Path(f).parent.name for f in result["files"]}) == 4  # 1, 2, 3 and 30 days ago
    assert all(Path(f).is_relative_to(tmp_path / "queue=billing") for f in result["files"])
    assert await count(db, "subqueue = 'X'") == 100
    # The other segment goes once no live lease holds one of its rows.
    await db.execute("UPDATE nmbus.billing SET lease_expires = now() - interval '1 minute'")
    text = (
        await cli("cleanup", "--older-than", "1s", "--failed-older-than", "35m", "--yes")
    ).stdout
    assert "billing" in text
    assert await count(db, "subqueue = 'X'") == 0
    assert await count(db, "subqueue = 'F'") == 1
    assert await count(db, "subqueue IN ('I', 'R')") == 9
    await cli("cleanup", "--older-than", "soon", code=2)
    await cli("cleanup", "nosuch", "--yes", code=1)


async def test_one_cleanup_removes_a_drained_queue_s_old_rows_and_says_what_went(
    cli: Cli, dsn: str, db: asyncpg.Connection
) -> None:
    """Sent, then drained, no worker running since: every row sits in segment 0, the
    segment being written. One `nmbus cleanup --older-than 1s` removes them all."""
    bus = Bus("billing", dsn=dsn, poll_interval=0.2, batch_size=50)

    @bus.handler(Ping)
    async def on_ping(msg: Ping, ctx: Context) -> None:
        pass

    async with bus:
        async with Bus("shop", dsn=dsn, concurrency=0) as shop:
            for n in range(300):
                await shop.send(Ping(n=n), to="billing")
        await drain(bus)
    assert await count(db, "subqueue = 'X'") == 300
    assert await db.fetchval("SELECT max(id) FROM nmbus.billing") < 2**36
    await wait_until(
        "SELECT count(*) FROM nmbus.billing WHERE last_processed >= now() - interval '1 second'",
        db=db,
        until=lambda n: n == 0,
    )
    dry = await cli.json("cleanup", "billing", "--older-than", "1s", "--dry-run")
    assert dry["queues"] == {"billing": {"X": 300, "F": 0}}
    refused = await cli("cleanup", "billing", "--older-than", "1s", code=1)  # it asks first
    assert "--yes" in refused.stderr and await count(db, "true") == 300
    size = await db.fetchval("""SELECT pg_total_relation_size('nmbus."billing$s0"')""")
    text = (await cli("cleanup", "billing", "--older-than", "1s", "--yes")).stdout
    assert await count(db, "true") == 0
    assert await db.fetchval("""SELECT to_regclass('nmbus."billing$s0"')""") is None
    freed = size_text(size)
    assert f"removed 300 row(s), dropped 1 segment(s) ({freed})" in text, text
    assert re.search(rf"billing\s+300\s+0\s+1\s+{re.escape(freed)}\s", text), text


async def test_version_and_ddl(cli: Cli) -> None:
    await cli("version", dsn=False)
    text = (await cli("queues", "ddl", "orders", "--schema", "ops", dsn=False)).stdout
    assert 'CREATE TABLE IF NOT EXISTS "ops"."orders"' in text


async def test_cancel(cli: Cli, facts: Facts, db: asyncpg.Connection) -> None:
    await db.execute(
        "INSERT INTO nmbus.billing (from_endpoint, to_endpoint, label, msg_text, unique_id, "
        "correlation_id) VALUES ('shop', 'billing', 'test.Ping', '{}', 'cancel-me', 'cart-1'), "
        "('shop', 'billing', 'test.Ping', '{}', 'cancel-too', 'cart-1')"
    )
    text = (await cli("cancel", "billing", "--unique-id", "cancel-me")).stdout
    assert "cancelled 1 message(s) in billing" in text
    assert await cli.json("cancel", "billing", "--correlation-id", "cart-1") == {
        "queue": "billing",
        "cancelled": 1,
    }
    assert await count(db, "unique_id LIKE 'cancel-%' AND error_info LIKE 'Cancelled%'") == 2
    assert await cli.json("cancel", "billing", "--unique-id", "cancel-me") == {
        "queue": "billing",
        "cancelled": 0,
    }
    await cli("cancel", "billing", code=2)  # say which
    await cli("cancel", "billing", "--unique-id", "a", "--correlation-id", "b", code=2)
    await cli("cancel", "nosuch", "--unique-id", "a", code=1)
