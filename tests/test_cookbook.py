"""Every query of the sql/ cookbook, run verbatim with psql on a populated database."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import UTC, timedelta
from pathlib import Path

import asyncpg

from nmbus import Bus, Context
from nmbus.ops.admin import schema_ddl
from nmbus.ports.store import SCHEMA_VERSION
from nmbus.postgres import install_schema
from tests.cookbook_run import COOKBOOK, psql
from tests.messages import Ping
from tests.ops_data import CHARGE_ERROR, REFUND_ERROR, Facts
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parent.parent
TESTED = {
    "queue_depth.sql",
    "all_queues.sql",
    "failed.sql",
    "requeue_one.sql",
    "requeue_all.sql",
    "processed_per_day.sql",
    "latency.sql",
    "oldest_ready.sql",
    "held_too_long.sql",
    "subscriptions.sql",
    "inject_message.sql",
    "blocked_sequences.sql",
    "segments.sql",  # on a partitioned queue table: tests/test_segments.py
    "held_back.sql",  # with limits declared: tests/test_flow_control.py
    "ready_backlog.sql",  # over segments, with limits: tests/test_health.py
}


def test_every_cookbook_file_is_tested() -> None:
    assert {p.name for p in COOKBOOK.glob("*.sql")} == TESTED


async def test_queue_depth(dsn: str, facts: Facts) -> None:
    got = await psql(dsn, "queue_depth.sql", queue="billing")
    assert got == [
        {"subqueue": "I", "messages": "6", "held_by_worker": "2"},
        {"subqueue": "R", "messages": "3", "held_by_worker": "0"},
        {"subqueue": "X", "messages": "165", "held_by_worker": "0"},
        {"subqueue": "F", "messages": "3", "held_by_worker": "0"},
    ]


async def test_queue_variable_is_required(dsn: str, facts: Facts) -> None:
    proc = await asyncio.create_subprocess_exec(
        "psql", dsn, "-X", "-q", "-f", str(COOKBOOK / "failed.sql"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert b"set the queue" in err and out == b""


async def test_all_queues(dsn: str, facts: Facts, db: asyncpg.Connection) -> None:
    # A queue still registered whose table is gone must not break the listing.
    await db.execute("INSERT INTO nmbus.queues (name) VALUES ('gone')")
    got = await psql(dsn, "all_queues.sql")
    assert got == [
        {"queue": "billing", "ready": "6", "scheduled": "3", "processed": "165", "failed": "3"},
        {"queue": "shipping", "ready": "1", "scheduled": "0", "processed": "0", "failed": "0"},
    ]


async def test_failed_with_errors(dsn: str, facts: Facts) -> None:
    got = await psql(dsn, "failed.sql", queue="billing")
    assert [r["id"] for r in got] == [str(i) for i in facts.failed_ids]
    types = ["billing.Charge", "billing.Refund", "billing.Charge"]
    assert [r["message_type"] for r in got] == types
    assert [r["error"] for r in got] == [
        CHARGE_ERROR.splitlines()[0],
        REFUND_ERROR.splitlines()[0],
        CHARGE_ERROR.splitlines()[0],
    ]
    assert {r["attempts"] for r in got} == {"5"}


async def _listen(dsn: str) -> tuple[asyncpg.Connection, asyncio.Queue[str]]:
    conn = await asyncpg.connect(dsn)
    got: asyncio.Queue[str] = asyncio.Queue()
    await conn.add_listener("nmbus_nmbus", lambda _c, _p, _ch, payload: got.put_nowait(payload))
    return conn, got


async def test_requeue_one(dsn: str, facts: Facts, db: asyncpg.Connection) -> None:
    target = facts.failed_ids[0]
    listener, notes = await _listen(dsn)
    try:
        got = await psql(dsn, "requeue_one.sql", queue="billing", id=target)
        assert got == [{"requeued": "1", "notified": "t"}]
        assert await asyncio.wait_for(notes.get(), 10) == "billing"
    finally:
        await listener.close()
    r = await db.fetchrow("SELECT *, now() AS db_now FROM nmbus.billing WHERE id = $1", target)
    assert r["subqueue"] == "I" and r["retry_count"] == 0
    assert r["handling_client_id"] is None and r["lease_expires"] is None
    assert abs(r["retry_time"] - r["db_now"]) < timedelta(minutes=1)
    assert r["error_info"] == CHARGE_ERROR  # kept as history until the next attempt
    # Not failed (any more): nothing happens.
    assert await psql(dsn, "requeue_one.sql", queue="billing", id=target) == [
        {"requeued": "0", "notified": "f"}
    ]
    left = await db.fetchval("SELECT count(*) FROM nmbus.billing WHERE subqueue = 'F'")
    assert left == 2


async def test_requeued_message_is_handled_again(
    dsn: str, db: asyncpg.Connection, make_bus: object
) -> None:
    """A message requeued with psql is picked up by a running worker, woken by NOTIFY."""
    bus = Bus("billing", dsn=dsn, poll_interval=60.0, lease_seconds=10.0)
    seen: asyncio.Queue[int] = asyncio.Queue()

    @bus.handler
    async def on_ping(msg: Ping, ctx: object) -> None:
        seen.put_nowait(msg.n)

    async with bus:
        await bus.send(Ping(n=7), to="billing")
        assert await asyncio.wait_for(seen.get(), 20) == 7
        # The handler ran; wait for its batch to commit.
        await wait_until(
            "SELECT subqueue FROM nmbus.billing", db=db, until=lambda sq: sq == "X", timeout=20
        )
        await db.execute("UPDATE nmbus.billing SET subqueue = 'F', retry_count = 5")
        # The fallback poll is a minute away: only the NOTIFY can wake the worker in time.
        got = await psql(dsn, "requeue_all.sql", queue="billing")
        assert got == [{"requeued": "1", "notified": "t"}]
        assert await asyncio.wait_for(seen.get(), 20) == 7
    row = await db.fetchrow("SELECT subqueue, retry_count FROM nmbus.billing")
    assert tuple(row) == ("X", 1)


async def test_injected_message_is_handled(dsn: str, db: asyncpg.Connection) -> None:
    """The queue is just a table: a message INSERTed with psql is handled like a sent one."""
    bus = Bus("billing", dsn=dsn, poll_interval=60.0, lease_seconds=10.0)
    seen: asyncio.Queue[tuple[int, str]] = asyncio.Queue()

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        seen.put_nowait((msg.n, ctx.unique_id))

    async with bus:
        # The fallback poll is a minute away: only the file's NOTIFY can wake the worker.
        got = await psql(dsn, "inject_message.sql", queue="billing", type="test.Ping",
                         body='{"n": 7}')  # fmt: skip
        assert len(got) == 1 and got[0]["notified"] == "t"
        n, unique_id = await asyncio.wait_for(seen.get(), 20)
        assert (n, unique_id) == (7, got[0]["unique_id"]) and len(unique_id) == 36
        # The handler ran; wait for its batch to commit.
        await wait_until(
            "SELECT subqueue FROM nmbus.billing", db=db, until=lambda sq: sq == "X", timeout=20
        )
        # A second injection gets a unique_id of its own (the dedup index stays).
        again = await psql(dsn, "inject_message.sql", queue="billing", type="test.Ping",
                           body='{"n": 8}', **{"from": "ops"})  # fmt: skip
        assert again[0]["unique_id"] != unique_id
        assert (await asyncio.wait_for(seen.get(), 20))[0] == 8
    rows = await db.fetch("SELECT id, from_endpoint, subqueue, retry_count FROM nmbus.billing")
    assert sorted(tuple(r) for r in rows) == [
        (int(got[0]["id"]), "psql", "X", 1),
        (int(again[0]["id"]), "ops", "X", 1),
    ]


async def test_inject_needs_queue_type_and_body(dsn: str) -> None:
    for given in ({}, {"queue": "billing"}, {"queue": "billing", "type": "test.Ping"}):
        args = [a for k, v in given.items() for a in ("-v", f"{k}={v}")]
        proc = await asyncio.create_subprocess_exec(
            "psql", dsn, "-X", "-q", *args, "-f", str(COOKBOOK / "inject_message.sql"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await proc.communicate()
        assert b"set the " in err and out == b""


async def test_requeue_all_by_type_then_all(dsn: str, facts: Facts, db: asyncpg.Connection) -> None:
    got = await psql(dsn, "requeue_all.sql", queue="billing", type="billing.Charge")
    assert got == [{"requeued": "2", "notified": "t"}]
    rows = await db.fetch("SELECT label FROM nmbus.billing WHERE subqueue = 'F'")
    assert [r[0] for r in rows] == ["billing.Refund"]
    assert await psql(dsn, "requeue_all.sql", queue="billing") == [
        {"requeued": "1", "notified": "t"}
    ]
    counts = await db.fetchrow(
        "SELECT count(*) FILTER (WHERE subqueue = 'F'), "
        "count(*) FILTER (WHERE id = ANY($1) AND subqueue = 'I' AND retry_count = 0) "
        "FROM nmbus.billing",
        facts.failed_ids,
    )
    assert tuple(counts) == (0, 3)


async def test_blocked_sequences_name_the_blocking_message(
    dsn: str, db: asyncpg.Connection
) -> None:
    async with Bus("sender", dsn=dsn, concurrency=0) as bus:
        for seq in ("acct-1", "acct-2", "acct-3"):
            for n in range(3):
                await bus.send(Ping(n=n), to="ledger", sequence=seq)
    ids = {
        r["sequence_key"]: r["id"]
        for r in await db.fetch(
            "SELECT DISTINCT ON (sequence_key) sequence_key, id FROM nmbus.ledger "
            "ORDER BY sequence_key, id"
        )
    }
    # acct-1: its head failed; acct-2: its head waits for a retry; acct-3 flows.
    await db.execute(
        "UPDATE nmbus.ledger SET subqueue = 'F', retry_count = 5, "
        "error_info = E'RuntimeError: no such account\\ntrace' WHERE id = $1",
        ids["acct-1"],
    )
    await db.execute(
        "UPDATE nmbus.ledger SET subqueue = 'R', retry_count = 1, "
        "retry_time = now() + interval '1 hour' WHERE id = $1",
        ids["acct-2"],
    )
    got = await psql(dsn, "blocked_sequences.sql", queue="ledger")
    keys = ("sequence_key", "blocking_id", "subqueue", "attempts", "waiting", "error")
    assert [{k: r[k] for k in keys} for r in got] == [
        {"sequence_key": "acct-1", "blocking_id": str(ids["acct-1"]), "subqueue": "F",
         "attempts": "5", "waiting": "2", "error": "RuntimeError: no such account"},
        {"sequence_key": "acct-2", "blocking_id": str(ids["acct-2"]), "subqueue": "R",
         "attempts": "1", "waiting": "2", "error": ""},
    ]  # fmt: skip


async def test_processed_per_day(dsn: str, facts: Facts) -> None:
    today = facts.now.astimezone(UTC).date()
    expected = Counter(
        t.astimezone(UTC).date()
        for t in facts.processed_at
        if t.astimezone(UTC).date() > today - timedelta(days=7)
    )
    got = await psql(dsn, "processed_per_day.sql", queue="billing")
    assert {r["day_utc"]: int(r["processed"]) for r in got} == {
        d.isoformat(): n for d, n in expected.items()
    }
    assert sum(expected.values()) == 160  # the 30-day-old rows are outside the window
    older = [r for r in got if r["day_utc"] < today.isoformat()]
    assert {r["avg_latency_ms"] for r in older} == {"1000.0"}
    wider = await psql(dsn, "processed_per_day.sql", queue="billing", days=40)
    assert sum(int(r["processed"]) for r in wider) == 165


async def test_latency_last_ten_minutes(dsn: str, facts: Facts) -> None:
    # Latencies 1..100 ms: mean 50.5, p99 (continuous) 1 + 0.99 * 99 = 99.01.
    got = await psql(dsn, "latency.sql", queue="billing")
    assert got == [{"processed": "100", "avg_ms": "50.5", "p99_ms": "99.0", "max_ms": "100.0"}]
    wider = await psql(dsn, "latency.sql", queue="billing", minutes=2 * 24 * 60 + 10)
    assert wider[0]["processed"] == "130"  # plus the 10 + 20 of one and two days ago


async def test_oldest_ready(dsn: str, facts: Facts) -> None:
    got = await psql(dsn, "oldest_ready.sql", queue="billing")
    # 4 free I, 1 I whose lease lapsed, 1 R that is due; not the live-leased or future ones.
    assert got[0]["waiting"] == "6"
    age = float(got[0]["oldest_age_seconds"])
    assert 30 * 60 <= age < 30 * 60 + 120


async def test_held_too_long(dsn: str, facts: Facts) -> None:
    got = await psql(dsn, "held_too_long.sql", queue="billing")
    assert [(r["held_by"], r["lease_lapsed"]) for r in got] == [
        ("host:1:live", "f"),
        ("host:2:dead", "t"),
    ]
    assert 20.0 <= float(got[0]["ready_for_minutes"]) < 22.0
    assert [r["held_by"] for r in await psql(dsn, "held_too_long.sql", queue="billing",
                                             minutes=15)] == ["host:1:live"]  # fmt: skip


async def test_subscriptions_per_publisher(dsn: str, facts: Facts) -> None:
    got = await psql(dsn, "subscriptions.sql")
    assert got == [
        {
            "publisher": "orders",
            "live": "3",
            "expired": "1",
            "message_types": "2",
            "live_subscribers": "billing, shipping",
        },
        {
            "publisher": "payments",
            "live": "1",
            "expired": "0",
            "message_types": "1",
            "live_subscribers": "billing",
        },
    ]


def test_schema_sql_is_generated_from_queries() -> None:
    assert (ROOT / "sql" / "schema.sql").read_text() == schema_ddl("nmbus", "billing"), (
        "sql/schema.sql is stale: python -m nmbus queues ddl billing > sql/schema.sql"
    )


async def test_schema_sql_runs_and_nmbus_accepts_it(dsn: str, db: asyncpg.Connection) -> None:
    await db.execute("DROP SCHEMA nmbus CASCADE")
    await psql(dsn, ROOT / "sql" / "schema.sql")
    await install_schema(db, "nmbus")  # recognises the version, migrates nothing
    async with Bus("sender", dsn=dsn, concurrency=0) as bus:
        await bus.send(Ping(n=1), to="billing")
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing WHERE subqueue = 'I'") == 1
    assert await db.fetchval("SELECT max(version) FROM nmbus.schema_version") == SCHEMA_VERSION
