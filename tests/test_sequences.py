"""Ordered sequences (docs/delivery.md): one member at a time, in send order."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from nmbus import Bus, Context, InvalidMessage, PermanentError, RetryLater
from nmbus.messages import Envelope
from nmbus.ops.admin import Admin
from nmbus.postgres import PostgresStore
from nmbus.postgres.floor import NO_FLOOR
from nmbus.postgres.sql import render
from nmbus.testing import MemoryStore, drain
from tests import procs
from tests.messages import Crash, Ping, Posted
from tests.pg import index_parts
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parent.parent


async def send_members(
    bus: Bus, seq: str, count: int, to: str = "ledger", start: int = 0
) -> list[str]:
    return [await bus.send(Posted(seq=seq, n=n), to=to, sequence=seq) for n in range(start, count)]


def events(lines: list[str]) -> list[tuple[int, str, str, int, int]]:
    """(time_ns, kind, seq, n, attempt) from the workers' start/fail/done lines."""
    out = []
    for line in lines:
        kind, *rest = line.split()
        if kind in ("start", "fail", "done"):
            seq, n, attempt, ns = rest
            out.append((int(ns), kind, seq, int(n), int(attempt)))
    return sorted(out)


def assert_one_at_a_time_in_order(evs: list[tuple[int, str, str, int, int]], seq: str) -> None:
    """Every start of member n comes after member n-1's final done, and none overlap."""
    running: int | None = None
    finished = -1
    for _, kind, s, n, _ in evs:
        if s != seq:
            continue
        if kind == "start":
            assert running is None, f"{n} started while {running} was running"
            assert n == finished + 1, f"{n} started before {finished + 1} succeeded"
            running = n
        else:
            assert running == n
            running = None
            if kind == "done":
                finished = n


async def start_workers(dsn: str, db: asyncpg.Connection, fails: str = "") -> list[procs.Proc]:
    await db.execute("CREATE TABLE seq_log (id serial, seq text, n int, pid int)")
    workers = [procs.Proc("tests.delivery_workers", "sequence", dsn, fails) for _ in range(2)]
    for w in workers:
        await w.wait_for("ready")
    return workers


async def wait_done(db: asyncpg.Connection, count: int, timeout: float = 60) -> None:
    await wait_until(
        "SELECT count(*) FROM seq_log",
        db=db,
        until=lambda n: n >= count,
        timeout=timeout,
        interval=0.1,
    )


async def test_twenty_members_on_two_processes_arrive_in_exactly_send_order(
    dsn: str, db: asyncpg.Connection, make_bus: Callable[..., Bus]
) -> None:
    workers = await start_workers(dsn, db)
    try:
        async with make_bus("sender", concurrency=0) as sender:
            # In bursts, each after both processes went idle: a burst's first members
            # wake a loop of each, which race for them, so both take part (sent at
            # once, the process that finishes a member mostly claims the next itself).
            for start in range(0, 20, 5):
                await send_members(sender, "account-42", start + 5, start=start)
                await send_members(sender, "account-7", start + 5, start=start)
                await wait_done(db, 2 * (start + 5))
                await asyncio.sleep(0.5)  # past the workers' poll interval: all idle
            for n in range(20):
                await sender.send(Ping(n=n), to="ledger")
        await wait_done(db, 40)
    finally:
        for w in workers:
            w.kill()
    for seq in ("account-42", "account-7"):
        logged = await db.fetch("SELECT n, pid FROM seq_log WHERE seq = $1 ORDER BY id", seq)
        assert [r["n"] for r in logged] == list(range(20))
        evs = events([line for w in workers for line in w.lines])
        assert_one_at_a_time_in_order(evs, seq)
    pids = {r["pid"] for r in await db.fetch("SELECT pid FROM seq_log")}
    assert len(pids) == 2  # both processes took part


async def test_a_member_that_fails_twice_holds_back_the_ones_after_it(
    dsn: str, db: asyncpg.Connection, make_bus: Callable[..., Bus]
) -> None:
    workers = await start_workers(dsn, db, fails="3")
    try:
        async with make_bus("sender", concurrency=0) as sender:
            await send_members(sender, "acct", 8)
        await wait_done(db, 8)
    finally:
        for w in workers:
            w.kill()
    assert [r["n"] for r in await db.fetch("SELECT n FROM seq_log ORDER BY id")] == list(range(8))
    evs = events([line for w in workers for line in w.lines])
    assert [e[4] for e in evs if e[1] == "fail"] == [1, 2]
    assert_one_at_a_time_in_order(evs, "acct")
    done3 = next(e[0] for e in evs if e[1] == "done" and e[3] == 3)
    assert all(e[0] > done3 for e in evs if e[3] > 3)


@pytest.mark.parametrize("store", ["postgres", "memory"])
async def test_a_retrying_member_does_not_hold_back_another_sequence(
    make_bus: Callable[..., Bus], store: str
) -> None:
    bus = (
        make_bus("ledger", poll_interval=0.2)
        if store == "postgres"
        else Bus("ledger", store=MemoryStore(), poll_interval=0.2)
    )
    seen: list[tuple[str, int]] = []

    @bus.handler
    async def on_posted(msg: Posted, ctx: Context) -> None:
        if msg.seq == "a" and msg.n == 0:
            raise RetryLater(3600, "the bank is closed")
        seen.append((msg.seq, msg.n))

    async with bus:
        await send_members(bus, "a", 3)
        await send_members(bus, "b", 3)
        await bus.send(Ping(n=1), to="ledger")  # no handler: F, and no sequence to block
        await drain(bus)
    assert seen == [("b", 0), ("b", 1), ("b", 2)]
    counts = await _counts(bus)
    assert counts == {"I": 2, "R": 1, "X": 3, "F": 1}


async def _counts(bus: Bus) -> dict[str, int]:
    await bus.store.open()
    try:
        return await bus.store.counts(bus.endpoint)
    finally:
        await bus.store.close()


async def test_an_f_member_blocks_its_sequence_until_requeued(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str
) -> None:
    broken = {"acct": True}
    bus = make_bus("ledger", poll_interval=0.2)
    seen: list[int] = []

    @bus.handler
    async def on_posted(msg: Posted, ctx: Context) -> None:
        if msg.n == 1 and broken["acct"]:
            raise PermanentError("account locked")
        seen.append(msg.n)

    async with bus:
        await send_members(bus, "acct", 4)
        await drain(bus)
        await asyncio.sleep(0.3)
        assert seen == [0]
        (blocked,) = await blocked_of(dsn, "ledger")
        head = await db.fetchval("SELECT id FROM nmbus.ledger WHERE msg_text LIKE '%\"n\":1%'")
        assert blocked.sequence_key == "acct"
        assert blocked.blocking_id == head
        assert blocked.subqueue == "F"
        assert blocked.waiting == 2
        assert blocked.error == "PermanentError: account locked"
        status = await asyncio.create_subprocess_exec(
            "nmbus", "status", "--dsn", dsn, "--json",
            stdout=asyncio.subprocess.PIPE, cwd=ROOT,
        )  # fmt: skip
        out, _ = await status.communicate()
        ledger = next(q for q in json.loads(out)["queues"] if q["queue"] == "ledger")
        assert [b["blocking_id"] for b in ledger["blocked"]] == [head]
        # The operator fixes the cause and requeues the member: the sequence goes on.
        broken["acct"] = False
        await db.execute("UPDATE nmbus.ledger SET subqueue = 'I' WHERE id = $1", head)
        bus.worker.wake()
        await wait_until(lambda: len(seen), until=lambda n: n >= 4, timeout=10)
    assert seen == [0, 1, 2, 3]
    assert await blocked_of(dsn, "ledger") == ()


async def blocked_of(dsn: str, queue: str) -> tuple[Any, ...]:
    async with Admin(dsn) as admin:
        return next(q for q in await admin.queue_status() if q.queue == queue).blocked


async def test_a_purged_f_member_lets_its_sequence_go_on(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("ledger", poll_interval=0.2)
    seen: list[int] = []

    @bus.handler
    async def on_posted(msg: Posted, ctx: Context) -> None:
        if msg.n == 0:
            raise PermanentError("bad")
        seen.append(msg.n)

    async with bus:
        await send_members(bus, "acct", 3)
        await drain(bus)
        assert seen == []
        await db.execute("DELETE FROM nmbus.ledger WHERE subqueue = 'F'")
        bus.worker.wake()
        await wait_until(lambda: len(seen), until=lambda n: n >= 2, timeout=10)
    assert seen == [1, 2]


async def test_a_member_killed_mid_way_is_recovered_before_the_next_starts(
    dsn: str, db: asyncpg.Connection, make_bus: Callable[..., Bus]
) -> None:
    # The first worker dies holding member 0; member 1 must wait for its recovery.
    await db.execute("CREATE TABLE effects (n int, pid int)")
    killer = procs.Proc("tests.workers", "worker", dsn, "ledger", "1.0")
    try:
        await killer.wait_for("ready")
        async with make_bus("sender", concurrency=0) as sender:
            await sender.send(Crash(n=0), to="ledger", sequence="s")
            await sender.send(Ping(n=1), to="ledger", sequence="s")
        await killer.wait_for("crashing 0")
    finally:
        killer.kill()
    rows = await db.fetch("SELECT subqueue FROM nmbus.ledger ORDER BY id")
    assert [r["subqueue"] for r in rows] == ["I", "I"]
    bus = make_bus("ledger", lease_seconds=1.0, poll_interval=0.2)
    seen: list[str] = []

    @bus.handler
    async def on_crash(msg: Crash, ctx: Context) -> None:
        seen.append(f"crash {msg.n} attempt {ctx.retry_count}")

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        seen.append(f"ping {msg.n}")

    async with bus:
        await wait_until(lambda: len(seen), until=lambda n: n >= 2, timeout=20, interval=0.1)
    assert seen == ["crash 0 attempt 2", "ping 1"]


async def test_publishing_in_a_sequence_keeps_its_order_in_every_subscriber_queue(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    subscribers = []
    for name in ("audit", "ledger"):
        sub = make_bus(name, concurrency=0)
        sub.subscribe(Posted, "bank")
        subscribers.append(sub)
    for sub in subscribers:
        async with sub:
            pass
    async with make_bus("bank", concurrency=0) as bank:
        for n in range(5):
            await bank.publish(Posted(seq="a", n=n), sequence="a", priority=3)
    for name in ("audit", "ledger"):
        rows = await db.fetch(
            f"SELECT sequence_key, priority, msg_text FROM nmbus.{name} ORDER BY id"
        )
        assert [r["sequence_key"] for r in rows] == ["a"] * 5
        assert [r["priority"] for r in rows] == [3] * 5
        assert [json.loads(r["msg_text"])["n"] for r in rows] == list(range(5))


@pytest.mark.parametrize(
    ("sequence", "match"),
    [("", "non-empty"), ("x" * 201, "over the limit"), ("a\x00b", "NUL"), (42, "non-empty")],
)
async def test_bad_sequence_keys_are_refused_at_send(
    make_bus: Callable[..., Bus], sequence: object, match: str
) -> None:
    async with make_bus("sender", concurrency=0) as bus:
        with pytest.raises(InvalidMessage, match=match):
            await bus.send(Ping(n=1), to="ledger", sequence=sequence)  # type: ignore[arg-type]


async def test_members_waiting_behind_a_blocked_head_cost_the_claim_nothing(
    dsn: str, db: asyncpg.Connection
) -> None:
    store = PostgresStore(dsn)
    await store.open()
    try:
        members = [member_envelope(n, "stuck") for n in range(20_000)]
        await store.insert("ledger", "me", members)
        await store.insert("ledger", "me", [member_envelope(n, None) for n in range(100)])
    finally:
        await store.close()
    # The head failed for good: 19,999 members wait, parked out of the ready index.
    await db.execute(
        "UPDATE nmbus.ledger SET subqueue = 'F' WHERE id = (SELECT min(id) FROM nmbus.ledger)"
    )
    parked = await db.fetchval(
        "SELECT count(*) FROM nmbus.ledger WHERE retry_time = 'infinity' AND sequence_key = 'stuck'"
    )
    assert parked == 19_999
    await db.execute("ANALYZE nmbus.ledger")
    plan = await db.fetchval(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + render("claim", "nmbus", "ledger"),
        100,
        "p",
        30.0,
        NO_FLOOR,
    )
    text = json.dumps(json.loads(plan))
    used = set(re.findall(r'"Index Name": "([^"]+)"', text))
    assert used & await index_parts(db, 'nmbus."ledger$ready"'), used
    # No segment holding rows is read whole (the empty next one may be).
    assert "ledger$s0" not in re.findall(r'"Seq Scan"[^{}]*?"Relation Name": "([^"]+)"', text)
    claimed = await db.fetch("SELECT sequence_key FROM nmbus.ledger WHERE handling_client_id = 'p'")
    assert len(claimed) == 100 and {r[0] for r in claimed} == {None}
    scan = _find(json.loads(plan)[0]["Plan"], "Index Scan")
    assert scan["Actual Rows"] == 100  # no parked member was even looked at
    assert scan.get("Rows Removed by Filter", 0) == 0


def _find(node: dict[str, Any], kind: str) -> dict[str, Any]:
    if node.get("Node Type") == kind:
        return node
    for child in node.get("Plans", []):
        found = _find(child, kind)
        if found:
            return found
    return {}


def member_envelope(n: int, seq: str | None) -> Envelope:
    uid = uuid.uuid4().hex
    return Envelope("test.Posted", f'{{"seq":"{seq}","n":{n}}}', None, uid, uid, None, 0, seq)


async def test_a_head_left_parked_by_a_race_is_released(dsn: str, db: asyncpg.Connection) -> None:
    store = PostgresStore(dsn)
    await store.open()
    try:
        await store.insert("ledger", "me", [member_envelope(n, "s") for n in range(3)])
        parked = await db.fetch("SELECT id, retry_time = 'infinity' AS parked FROM nmbus.ledger")
        assert [r["parked"] for r in sorted(parked, key=lambda r: r["id"])] == [False, True, True]
        # The head reaches X without its finish unparking the next one (as when a send
        # and its predecessor's finish commit at the same time, or a head is deleted).
        await db.execute(
            "UPDATE nmbus.ledger SET subqueue = 'X' WHERE id = (SELECT min(id) FROM nmbus.ledger)"
        )
        async with store.worker_session() as session:
            assert await session.claim("ledger", 10, "c1", 30.0) == []
            assert await session.release_sequences("ledger") == 1
            assert await session.release_sequences("ledger") == 0
            (nxt,) = await session.claim("ledger", 10, "c1", 30.0)
        assert nxt.msg_text == '{"seq":"s","n":1}'
    finally:
        await store.close()


async def test_the_loops_of_a_worker_release_parked_heads_once_for_the_process(
    make_bus: Callable[..., Bus], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The statement walks every sequence key outside X: four loops must not run it
    # four times as often as one. Idle, it runs once a poll interval for the process
    # (each loop on its own ran it at its every wake-up and every poll interval).
    from nmbus.postgres.session import PostgresSession

    calls = 0
    real = PostgresSession.release_sequences

    async def counted(self: PostgresSession, queue: str) -> int:
        nonlocal calls
        calls += 1
        return await real(self, queue)

    monkeypatch.setattr(PostgresSession, "release_sequences", counted)
    bus = make_bus("ledger", concurrency=4, poll_interval=0.2)

    @bus.handler
    async def handle(msg: Posted, ctx: Context) -> None: ...

    async with bus:
        await asyncio.sleep(0.5)
        calls, began = 0, asyncio.get_running_loop().time()
        await asyncio.sleep(3.0)
        elapsed = asyncio.get_running_loop().time() - began
    intervals = elapsed / 0.2
    assert 0 < calls <= intervals + 2, (calls, intervals)
