"""A queue's segments on a real PostgreSQL: the reads, the commands and the queue's page.

A queue table becomes a partitioned table, its partitions ``<queue>$s<n>``
(DESIGN.md section 10). These tests build such a table by hand, as a
lookalike of the queue table nmbus makes, and check what an operator sees of
it: the segments found through pg_inherits, their insert times probed through
the primary key, their rows not in X counted without a scan of the X rows.
The plain-table case (a schema not yet upgraded) is one segment, number 0.
The port's contract over both stores is in tests/test_operations_contract.py.
"""

from __future__ import annotations

import asyncio
import html
import json
import re
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import pytest
from typer.testing import CliRunner, Result

from nmbus.cli import app
from nmbus.ops.admin import Admin
from nmbus.postgres.sql import render
from tests.cookbook_run import psql
from tests.dashboard_server import start
from tests.ops_data import COLUMNS, create_queue, row

SPAN = 2**36  # ids a segment covers
runner = CliRunner()


async def partitioned(db: asyncpg.Connection, queue: str, segments: int) -> None:
    """Make ``queue`` (created the normal way) a partitioned lookalike with ``segments``
    segments ``<queue>$s<n>``, each covering ids n * 2^36 up to (n+1) * 2^36."""
    await create_queue(db, queue)
    q, old = f'nmbus."{queue}"', f'nmbus."{queue}_old"'
    await db.execute(f'ALTER TABLE {q} RENAME TO "{queue}_old"')
    await db.execute(
        f"CREATE TABLE {q} (LIKE {old} INCLUDING DEFAULTS INCLUDING IDENTITY "
        "INCLUDING CONSTRAINTS) PARTITION BY RANGE (id)"
    )
    await db.execute(f"DROP TABLE {old}")
    await db.execute(f'ALTER TABLE {q} ADD CONSTRAINT "{queue}$pkey" PRIMARY KEY (id)')
    await db.execute(
        f'CREATE INDEX "{queue}$ready" ON {q} (priority DESC, retry_time, id) '
        "WHERE subqueue IN ('I', 'R') AND retry_time < 'infinity'"
    )
    await db.execute(render("queue_sequence_index", "nmbus", queue))
    await db.execute(render("queue_done_index", "nmbus", queue))
    for n in range(segments):
        low = "MINVALUE" if n == 0 else str(n * SPAN)
        await db.execute(
            f'CREATE TABLE nmbus."{queue}$s{n}" PARTITION OF {q} '
            f"FOR VALUES FROM ({low}) TO ({(n + 1) * SPAN})"
        )


async def plain(db: asyncpg.Connection, queue: str) -> None:
    """Make ``queue`` a plain table, whatever the normal way makes: a schema not yet upgraded."""
    await create_queue(db, queue)
    q, old = f'nmbus."{queue}"', f'nmbus."{queue}_old"'
    await db.execute(f'ALTER TABLE {q} RENAME TO "{queue}_old"')
    await db.execute(f"CREATE TABLE {q} (LIKE {old} INCLUDING ALL)")
    await db.execute(f"DROP TABLE {old}")


async def put(
    db: asyncpg.Connection, queue: str, first_id: int, fates: str, start: datetime
) -> None:
    """One row per letter of ``fates`` (its subqueue), ids from ``first_id``, inserted a
    second apart from ``start``."""
    values = ", ".join(f"${i}::jsonb" if i == 12 else f"${i}" for i in range(1, 16))
    rows = []
    for k, fate in enumerate(fates):
        at = start + timedelta(seconds=k)
        done = at if fate in "XF" else None
        rows.append((first_id + k, *row(fate, retry_time=at, last_processed=done, queue=queue)))
    await db.executemany(
        f'INSERT INTO nmbus."{queue}" (id, {COLUMNS}) OVERRIDING SYSTEM VALUE VALUES ({values})',
        rows,
    )


@pytest.fixture
async def billing(db: asyncpg.Connection) -> datetime:
    """billing: segment 0 with 200 X, 2 F and 1 I three days ago; segment 1 (being written)
    with 50 X, 3 I, 2 R and 1 F an hour ago; segment 2 empty, ahead. shipping: a plain table
    with 2 X and 1 I. Returns when billing's first row was inserted."""
    now: datetime = await db.fetchval("SELECT date_trunc('second', now())")
    await partitioned(db, "billing", 3)
    await put(db, "billing", 1, "X" * 200 + "FFI", now - timedelta(days=3))
    await put(db, "billing", SPAN, "X" * 50 + "IIIRRF", now - timedelta(hours=1))
    await plain(db, "shipping")
    await put(db, "shipping", 1, "XXI", now - timedelta(minutes=5))
    await db.execute('ANALYZE nmbus."billing$s0", nmbus."billing$s1", nmbus.shipping')
    return now - timedelta(days=3)


async def test_the_segments_of_a_partitioned_queue_and_of_a_plain_one(
    dsn: str, billing: datetime
) -> None:
    async with Admin(dsn) as admin:
        found = await admin.queue_segments()
        assert await admin.queue_segments(["shipping", "billing"]) == [
            *[s for s in found if s.queue == "shipping"],
            *[s for s in found if s.queue == "billing"],
        ]
    s0, s1, s2, shipping = found
    assert [(s.queue, s.name, s.number) for s in found] == [
        ("billing", "billing$s0", 0),
        ("billing", "billing$s1", 1),
        ("billing", "billing$s2", 2),
        ("shipping", "shipping", 0),
    ]
    assert (s0.pending, s1.pending, s2.pending, shipping.pending) == (3, 6, 0, 1)
    assert (s0.oldest, s0.newest) == (billing, billing + timedelta(seconds=202))
    hour_ago = billing + timedelta(days=3) - timedelta(hours=1)
    assert (s1.oldest, s1.newest) == (hour_ago, hour_ago + timedelta(seconds=55))
    assert (s2.oldest, s2.newest, s2.rows) == (None, None, 0)
    # Estimates, not counts: after ANALYZE at least the rows there are.
    assert (s0.rows >= 203, s1.rows >= 56, shipping.rows >= 3) == (True, True, True)
    assert all(s.size_bytes > 0 for s in found)
    assert s0.size_bytes > s2.size_bytes


async def test_the_probe_never_reads_the_x_rows(
    dsn: str, db: asyncpg.Connection, billing: datetime
) -> None:
    """What ops_segment_probe reads of a segment of 5,200 X rows and 3 pending ones: the
    pending rows through the partial indexes, and one row per probe of the primary key."""
    await put(db, "billing", 1000, "X" * 5000, billing - timedelta(days=1))
    await db.execute('ANALYZE nmbus."billing$s0"')
    oids = [
        await db.fetchval("SELECT $1::regclass::oid", f'nmbus."billing$s{n}"') for n in (0, 1, 2)
    ]
    firsts, lasts = [-(2**63), SPAN, 2 * SPAN], [SPAN - 1, 2 * SPAN - 1, 3 * SPAN - 1]
    sql = "EXPLAIN (ANALYZE, FORMAT JSON) " + render("ops_segment_probe", "nmbus", "billing")
    (plan,) = json.loads(await db.fetchval(sql, oids, firsts, lasts))
    read = [n for n in _nodes(plan["Plan"]) if n.get("Relation Name") == "billing$s0"]
    assert read, plan
    for node in read:
        assert node["Node Type"] != "Seq Scan", node
        rows = node["Actual Rows"] * node["Actual Loops"]
        assert rows + node.get("Rows Removed by Filter", 0) <= 3, node
    async with Admin(dsn) as admin:
        assert (await admin.queue_segments(["billing"]))[0].pending == 3


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(n for child in node.get("Plans", []) for n in _nodes(child))]


# -- the commands ------------------------------------------------------------------------


async def invoke(dsn: str, *argv: str, code: int = 0) -> Result:
    env = {"COLUMNS": "200", "NMBUS_DSN": None}
    result = await asyncio.to_thread(runner.invoke, app, [*argv, "--dsn", dsn], env=env)
    assert result.exit_code == code, (argv, result.output, result.exception)
    return result


async def test_nmbus_segments_lists_each_segment(dsn: str, billing: datetime) -> None:
    text = (await invoke(dsn, "segments")).stdout
    lines = text.splitlines()
    assert lines[1].split() == [
        "queue", "segment", "n", "oldest", "newest", "rows", "pending", "size",
    ]  # fmt: skip
    s0 = next(line for line in lines if "billing$s0" in line).split()
    assert s0[:3] == ["billing", "billing$s0", "0"] and s0[-3] == "3"  # pending
    assert re.search(r"billing\$s2\s+2\s+-\s+-\s+~0\s+0\s", text), text
    assert re.search(r"shipping\s+shipping\s+0\s", text), text
    got = json.loads((await invoke(dsn, "segments", "billing", "--json")).stdout)
    assert [(s["name"], s["pending"]) for s in got] == [
        ("billing$s0", 3),
        ("billing$s1", 6),
        ("billing$s2", 0),
    ]
    assert got[0]["oldest"] == billing.isoformat() and got[2]["newest"] is None
    missing = await invoke(dsn, "segments", "nosuch", code=1)
    assert missing.stderr.strip() == "error: no such queue(s): nosuch"
    bad = await invoke(dsn, "segments", "bad name!", code=2)
    assert len(bad.stderr.strip().splitlines()) == 1 and "invalid queue name" in bad.stderr


async def test_nmbus_status_sums_up_the_segments(dsn: str, billing: datetime) -> None:
    got = json.loads((await invoke(dsn, "status", "--json")).stdout)
    by_name = {q["queue"]: q for q in got["queues"]}
    assert by_name["billing"]["segments"] == 3
    assert by_name["billing"]["oldest_insert_time"] == billing.isoformat()
    assert by_name["billing"]["size_bytes"] > 0
    assert by_name["shipping"]["segments"] == 1
    text = (await invoke(dsn, "status")).stdout
    header = next(line for line in text.splitlines() if line.startswith("queue "))
    assert header.split()[-4:] == ["segments", "oldest", "row", "size"]
    assert re.search(r"^billing .* 3 +\S+ \S+ +[\d.]+ [KMG]iB$", text, re.MULTILINE), text


# -- the dashboard -----------------------------------------------------------------------


async def test_the_queue_page_shows_its_segments_newest_first_at_most_50(
    dsn: str, db: asyncpg.Connection, billing: datetime
) -> None:
    await partitioned(db, "wide", 53)
    await put(db, "wide", 52 * SPAN, "I", billing)
    # A segment attached by hand under a name of its own: shown, escaped, numbered by its bounds.
    await db.execute(
        'CREATE TABLE nmbus."wide$<b>x" PARTITION OF nmbus.wide '
        f"FOR VALUES FROM ({60 * SPAN}) TO ({61 * SPAN})"
    )
    server = await start(dsn, "--read-only")
    try:
        status, page, _ = server.get("/queues/billing")
        assert status == 200
        names = re.findall(r'<tr data-segment="([^"]+)">', page)
        assert names == ["billing$s2", "billing$s1", "billing$s0"]
        summary = _text(page.split('id="segments-summary"')[1].split("</dl>")[0])
        oldest = f"{billing:%Y-%m-%d %H:%M:%S} UTC"
        assert re.fullmatch(rf"segments 3 oldest row {oldest} size [\d.]+ KiB", summary), summary
        being_written = page.split('data-segment="billing$s1"')[1].split("</tr>")[0]
        assert "(being written)" in being_written and "≈" in being_written
        assert "segments-more" not in page
        status, page, _ = server.get("/queues/wide")
        assert status == 200
        names = re.findall(r'<tr data-segment="([^"]+)">', page)
        assert len(names) == 50 and names[0] == "wide$&lt;b&gt;x" and names[1] == "wide$s52"
        assert "<b>x" not in page
        more = _text(page.split('id="segments-more"')[1].split("</p>")[0])
        assert more.startswith("4 older segments not shown")
        hand_made = _text(page.split('data-segment="wide$&lt;b&gt;x"')[1].split("</tr>")[0])
        assert hand_made.split()[:2] == ["wide$<b>x", "60"]
    finally:
        server.proc.terminate()
        server.proc.wait(15)
        for stream in (server.proc.stdout, server.proc.stderr):
            if stream is not None:
                stream.close()


def _text(fragment: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment.lstrip(">"))).split())


# -- the cookbook -------------------------------------------------------------------------


async def test_the_cookbook_lists_a_queue_s_segments(dsn: str, billing: datetime) -> None:
    got = await psql(dsn, "segments.sql", queue="billing")
    assert [(r["segment"], r["low_id"], r["high_id"]) for r in got] == [
        ("billing$s0", "", str(SPAN)),
        ("billing$s1", str(SPAN), str(2 * SPAN)),
        ("billing$s2", str(2 * SPAN), str(3 * SPAN)),
    ]
    assert [r["newest_insert_time"] == "" for r in got] == [False, False, True]
    assert int(got[0]["rows_estimate"]) >= 203 and got[0]["size"].endswith("kB")
    (one,) = await psql(dsn, "segments.sql", queue="shipping")
    assert (one["segment"], one["low_id"], one["high_id"]) == ("shipping", "", "")
    assert one["oldest_insert_time"] != ""
