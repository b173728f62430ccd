"""Failover: the primary stopped with ``-m immediate`` mid-run, its streaming standby promoted.

A primary and a standby of the test's own (tests/standby.py), a DSN that names
both with ``target_session_attrs=read-write``, two worker processes
(tests/failover_workers.py: an effect through ``ctx.connection``, one outside
the database, a copy through the outbox and the forwarder to another database,
retention every half second) and four sender tasks. The standby stops
receiving WAL just before the primary dies, as a standby that lags. Nobody
restarts anything: the processes must find the new primary by themselves.
Then the old primary is started again as a standby of the new one, and must
never see a write.

With synchronous replication nothing a send returned for is lost; with
asynchronous replication the test measures what is (the last commits not yet
streamed). In both, no message is handled twice transactionally.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from nmbus import Bus, DatabaseUnavailable
from nmbus.postgres.listen import notify_channel
from tests.failover_workers import RECONNECT_MAX, SLOW
from tests.messages import Ping
from tests.procs import Proc
from tests.standby import Pair, log_lines, replicated
from tests.waits import wait_until

pytestmark = pytest.mark.reliability

QUEUE = "billing"
SENDERS = 4
#: A send waits at most this long for a connection (the pools' connect timeout).
CONNECT_TIMEOUT = 10.0
#: Sends that returned before the primary is stopped, after the promotion, and
#: through a new sender once the old primary is back as a standby.
BEFORE, AFTER, LAST = 400, 400, 200
SLOW_PINGS = 4
#: Asynchronous: sends that return after the standby stopped receiving, before the stop.
CUT_OFF = 20


class Senders:
    """``SENDERS`` tasks sending Pings through one Bus until stopped; what each send did."""

    def __init__(self, bus: Bus, numbers: Iterator[int], ok: dict[str, int]) -> None:
        self.bus = bus
        self.numbers = numbers
        self.ok = ok  # unique id -> n, of every send that returned
        self.errors: list[tuple[str, float]] = []  # the exception's type, the send's time
        self.longest = 0.0
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._send()) for _ in range(SENDERS)]

    async def _send(self) -> None:
        while not self._stop.is_set():
            n = next(self.numbers)
            started = time.monotonic()
            try:
                await self.bus.send(Ping(n=n), to=QUEUE, unique_id=f"s{n}")
            except Exception as exc:  # every kind is recorded: only one may be seen
                self.errors.append((type(exc).__name__, time.monotonic() - started))
                await asyncio.sleep(0.02)
            else:
                self.ok[f"s{n}"] = n
            self.longest = max(self.longest, time.monotonic() - started)
            await asyncio.sleep(0.002)

    async def until(self, more: int) -> None:
        """Until ``more`` further sends have returned."""
        wanted = len(self.ok) + more
        await wait_until(lambda: len(self.ok), until=lambda n: n >= wanted, timeout=90)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


@dataclass
class Outcome:
    """What a failover run left, read from the new primary, the files and the logs."""

    ok: dict[str, int] = field(default_factory=dict)
    after_cut: set[str] = field(default_factory=set)  # returned once the standby lagged
    errors: list[tuple[str, float]] = field(default_factory=list)
    longest_send: float = 0.0
    stopped: float = 0.0  # epoch seconds: the old primary stopped
    promoted: float = 0.0  # the promotion seen done: the new primary takes writes
    first_after: float = 0.0  # the first effect committed after the stop
    rows: dict[str, str] = field(default_factory=dict)  # unique id -> subqueue
    effects: Counter[int] = field(default_factory=Counter)
    outside: Counter[int] = field(default_factory=Counter)
    outbox: int = 0
    audit: set[str] = field(default_factory=set)  # the copies' unique ids, in the other database
    logs: list[list[dict[str, Any]]] = field(default_factory=list)
    old_primary_log: list[str] = field(default_factory=list)
    old_primary_in_recovery: bool = False
    workers_alive: bool = False

    def processed(self) -> dict[str, str]:
        return {uid: sub for uid, sub in self.rows.items() if sub == "X"}

    def print(self, name: str) -> None:
        lost = [uid for uid in self.ok if uid not in self.rows]
        again = sum(1 for n, c in self.outside.items() if c > 1)
        kinds = Counter(kind for kind, _ in self.errors)
        print(
            f"failover ({name}): {len(self.ok)} sends returned, {len(lost)} of them lost; "
            f"{len(self.errors)} raised {dict(kinds)} (longest send "
            f"{self.longest_send:.2f} s); first message handled on the new primary "
            f"{self.first_after - self.promoted:.2f} s after the promotion "
            f"({self.first_after - self.stopped:.2f} s after the stop, reconnect_max_delay "
            f"{RECONNECT_MAX} s); {again} handled again outside the database, "
            f"{sum(1 for c in self.effects.values() if c > 1)} twice transactionally"
        )


@pytest.fixture(params=[True, False], ids=["synchronous", "asynchronous"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    with replicated(synchronous=request.param) as started:
        yield started


def _read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


async def _failover(pair: Pair, audit_dsn: str, tmp_path: Path) -> Outcome:
    both = pair.dsn()
    conn = await asyncpg.connect(pair.dsn(pair.primary))
    try:
        await conn.execute(
            "CREATE TABLE effects (n bigint NOT NULL, pid int NOT NULL, "
            "at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
    finally:
        await conn.close()
    out = Outcome()
    outside = tmp_path / "outside"
    outside.touch()
    logs = [tmp_path / f"worker-{i}.log" for i in range(2)]
    workers = [
        Proc("tests.failover_workers", both, QUEUE, audit_dsn, str(outside), str(log))
        for log in logs
    ]
    numbers = itertools.count()
    # Open before the stop, it sees the promotion end: the moment the standby takes writes.
    watch = await asyncpg.connect(pair.dsn(pair.standby, read_write=False))
    watch_primary = await asyncpg.connect(pair.dsn(pair.primary))
    try:
        for worker in workers:
            await worker.wait_for("ready")
        async with Bus("orders", dsn=both, concurrency=0) as bus:
            senders = Senders(bus, numbers, out.ok)
            try:
                await senders.until(BEFORE)
                # The standby falls behind just before the primary dies: asynchronous, the
                # primary goes on committing what the standby never gets; synchronous, its
                # commits wait for a standby.
                await asyncio.to_thread(pair.cut)
                before_cut = set(out.ok)
                if pair.synchronous:
                    await wait_until(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'",
                        db=watch_primary,
                        until=lambda n: n >= 1,
                        what="commits waiting for a synchronous standby",
                    )
                else:
                    await senders.until(CUT_OFF)
                await watch_primary.close()
                await asyncio.to_thread(pair.primary.stop, "immediate")
                out.stopped = time.time()
                out.after_cut = set(out.ok) - before_cut
                await asyncio.to_thread(pair.standby.promote)
                await wait_until(
                    "SELECT NOT pg_is_in_recovery()", db=watch, interval=0.01, what="the promotion"
                )
                out.promoted = time.time()
                await senders.until(AFTER)
                # The old primary back as a standby of the new one; every statement
                # that would change data, and every connection, goes into its log.
                mark = pair.primary.log.stat().st_size
                pair.primary.settings.update(log_connections="on", log_statement="mod")
                pair.primary.follow(pair.standby)
                await asyncio.to_thread(pair.primary.start)
                await senders.until(AFTER // 4)
            except BaseException:
                # Sends waiting for a synchronous standby would keep the pool from closing.
                await asyncio.to_thread(pair.remove)
                raise
            finally:
                await senders.stop()
        # A new pool connects afresh: to the old primary first, the DSN names it first.
        async with Bus("orders", dsn=both, concurrency=0) as bus:
            fresh = Senders(bus, numbers, out.ok)
            await fresh.until(LAST)
            await fresh.stop()
            # Handlers that run past their lease on the new primary: each runs once
            # only while the lease renewer reconnected.
            for i in range(SLOW_PINGS):
                n = SLOW + i
                await bus.send(Ping(n=n), to=QUEUE, unique_id=f"s{n}")
                out.ok[f"s{n}"] = n
        out.errors = senders.errors + fresh.errors
        out.longest_send = max(senders.longest, fresh.longest)

        new = await asyncpg.connect(pair.dsn(pair.standby))
        audit = await asyncpg.connect(audit_dsn)
        try:
            await wait_until(
                f"SELECT count(*) FROM nmbus.{QUEUE} WHERE subqueue IN ('I', 'R')",
                db=new,
                until=lambda n: n == 0,
                timeout=60,
                what="the queue drained on the new primary",
            )
            await wait_until(
                "SELECT count(*) FROM nmbus.outbox",
                db=new,
                until=lambda n: n == 0,
                timeout=30,
                what="the outbox forwarded",
            )
            out.workers_alive = all(w.popen.poll() is None for w in workers)
            out.rows = dict(await new.fetch(f"SELECT unique_id, subqueue FROM nmbus.{QUEUE}"))
            out.effects = Counter(r[0] for r in await new.fetch("SELECT n FROM effects"))
            out.first_after = float(
                await new.fetchval(
                    "SELECT extract(epoch FROM min(at)) FROM effects WHERE at > to_timestamp($1)",
                    out.stopped,
                )
            )
            out.outbox = int(await new.fetchval("SELECT count(*) FROM nmbus.outbox"))
            out.audit = {r[0] for r in await audit.fetch("SELECT unique_id FROM nmbus.audit")}
        finally:
            await new.close()
            await audit.close()
        old = await asyncpg.connect(pair.dsn(pair.primary, read_write=False))
        try:
            out.old_primary_in_recovery = bool(await old.fetchval("SELECT pg_is_in_recovery()"))
        finally:
            await old.close()
        out.old_primary_log = log_lines(pair.primary, mark)
    finally:
        watch.terminate()
        watch_primary.terminate()
        for worker in workers:
            worker.kill()
    out.outside = Counter(int(line) for line in outside.read_text().split())
    out.logs = [_read_log(log) for log in logs]
    return out


def _after(log: list[dict[str, Any]], event: str, since: float, **fields: str) -> bool:
    return any(
        e.get("event") == event and e["t"] > since and fields.items() <= e.items() for e in log
    )


def _assert_common(out: Outcome) -> None:
    # Senders saw the switch as DatabaseUnavailable, never a raw driver error, and no
    # send waited past the connect timeout.
    assert out.errors, "no send met the failover"
    assert {kind for kind, _ in out.errors} == {DatabaseUnavailable.__name__}, out.errors[:5]
    assert out.longest_send < CONNECT_TIMEOUT, out.longest_send

    # Nothing left in I/R (nor in F); each message handled once transactionally, with
    # its copy forwarded to the other database once.
    assert set(out.rows.values()) == {"X"}, Counter(out.rows.values())
    processed = {int(uid[1:]) for uid in out.processed()}
    assert set(out.effects) == processed
    assert [n for n, c in out.effects.items() if c != 1] == []
    assert out.outbox == 0
    copies = {f"audit-{n}" for n in processed}
    assert copies <= out.audit
    # A copy beyond those is one the forwarder moved before the failover, of a message
    # the new primary never got (asynchronous replication lost it).
    lost = {f"audit-{n}" for uid, n in out.ok.items() if uid not in out.rows}
    assert out.audit - copies <= lost

    # The handlers that outlived their lease on the new primary ran once each:
    # their leases were renewed there.
    slow = [SLOW + i for i in range(SLOW_PINGS)]
    assert [out.outside[n] for n in slow] == [1] * SLOW_PINGS

    # The same two processes did it all, each finding the new primary by itself:
    # its worker loops, its listener and its retention.
    assert out.workers_alive
    for log in out.logs:
        events = {e["event"] for e in log}
        assert {"worker_connection_lost", "worker_reconnected"} <= events, sorted(events)
        assert "listener_connection_lost" in events, sorted(events)
        # The workers' own listener (the forwarder has one too, on the outbox's channel).
        listening = _after(log, "listener_connected", out.stopped, channel=notify_channel("nmbus"))
        assert listening, "no listener on the new primary"
        assert _after(log, "retention_done", out.stopped), "no retention on the new primary"
    assert out.first_after > out.stopped

    # The old primary, back as a standby: reached by nmbus's connections (the DSN
    # names it first), refused by them (read-only), never written to.
    assert out.old_primary_in_recovery
    connections = [x for x in out.old_primary_log if "connection authorized" in x]
    assert any("database=failover" in x for x in connections), out.old_primary_log[-20:]
    writes = [x for x in out.old_primary_log if "statement: " in x or "execute " in x]
    assert writes == []
    assert not any("read-only transaction" in x for x in out.old_primary_log)


@pytest.mark.timeout(300)
async def test_failover(pair: Pair, dsn: str, tmp_path: Path) -> None:
    """``dsn`` (the shared server) is the other database the forwarder moves copies to."""
    out = await _failover(pair, dsn, tmp_path)
    name = "synchronous" if pair.synchronous else "asynchronous"
    out.print(name)
    _assert_common(out)
    lost = {uid for uid in out.ok if uid not in out.rows}
    if pair.synchronous:
        # Every send that returned is there, and was handled: the commits the standby
        # did not get were never acknowledged.
        assert lost == set()
        assert out.after_cut == set()
    else:
        # What the promoted standby never got is gone: every send that returned after
        # it stopped receiving, and perhaps a few just before (measured, printed above).
        assert len(out.after_cut) >= CUT_OFF
        assert out.after_cut <= lost
