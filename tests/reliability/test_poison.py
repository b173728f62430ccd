"""A message that kills its worker ends in F alone: its batch-mates end in X.

A supervisor restarts the worker each time the poison SIGKILLs it, as a
process manager would. Whatever the poison's place in the queue and the batch
size, the innocent messages must each be handled (committed) exactly once and
the poison must end in F once its attempts are used up.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import Callable

import asyncpg
import pytest

from nmbus import Bus
from tests.messages import Ping
from tests.procs import Proc

pytestmark = pytest.mark.reliability

MESSAGES = 10
MAX_ATTEMPTS = 3  # tests/workers.py


async def _supervise(
    dsn: str, db: asyncpg.Connection, batch_size: int, pill: int, *extra: str
) -> list[str]:
    """Run the worker until nothing is left to do, restarting it whenever it dies."""
    lines: list[str] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        open_rows = await db.fetchval(
            "SELECT count(*) FROM nmbus.billing WHERE subqueue IN ('I', 'R')"
        )
        if open_rows == 0:
            return lines
        args = ("1.0", str(batch_size), str(pill), *extra)  # the shortest lease accepted
        proc = Proc("tests.workers", "poison", dsn, "billing", *args)
        try:
            while proc.popen.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                if not await db.fetchval(
                    "SELECT count(*) FROM nmbus.billing WHERE subqueue IN ('I', 'R')"
                ):
                    break
        finally:
            proc.kill()
            lines.extend(proc.lines)
    raise AssertionError(f"the queue did not empty in time; worker output: {lines[-20:]}")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("batch_size", [1, 5, 100])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
async def test_a_poison_message_takes_no_batch_mate_with_it(
    dsn: str,
    make_bus: Callable[..., Bus],
    db: asyncpg.Connection,
    batch_size: int,
    position: str,
) -> None:
    pill = {"first": 1, "middle": 6, "last": MESSAGES}[position]
    await db.execute("CREATE TABLE effects (n int, pid int)")
    async with make_bus("billing", concurrency=0) as sender:
        for n in range(1, MESSAGES + 1):
            await sender.send(Ping(n=n), to="billing")

    lines = await _supervise(dsn, db, batch_size, pill)

    rows = await db.fetch("SELECT msg_text, subqueue, error_info FROM nmbus.billing ORDER BY id")
    ends = {n: row["subqueue"] for n, row in enumerate(rows, start=1)}
    assert ends == {n: "F" if n == pill else "X" for n in range(1, MESSAGES + 1)}
    assert rows[pill - 1]["error_info"].startswith(
        f"AttemptsExhausted: {MAX_ATTEMPTS} attempts were started"
    )
    # Each innocent message was committed once: its one transaction that survived.
    written = await db.fetch("SELECT n, xmin::text AS xid FROM effects")
    effects = Counter(r["n"] for r in written)
    assert effects == Counter({n: 1 for n in range(1, MESSAGES + 1) if n != pill})
    # Each in a savepoint of its own (a subtransaction id each), which the test
    # without savepoints below tells apart.
    assert len({r["xid"] for r in written}) == len(written)
    # It ran at most twice: in the batch that died (rolled back), then on its own.
    runs = Counter(int(m.group(1)) for m in map(re.compile(r"ran (\d+) ").match, lines) if m)
    assert max(c for n, c in runs.items() if n != pill) <= 2
    # The poison killed a worker once per counted attempt, plus at most once in a batch.
    assert MAX_ATTEMPTS <= runs[pill] <= MAX_ATTEMPTS + 1


@pytest.mark.timeout(150)
@pytest.mark.parametrize("batch_size", [5, 100])
async def test_a_crash_in_a_batch_without_savepoints_commits_each_mate_once(
    dsn: str, make_bus: Callable[..., Bus], db: asyncpg.Connection, batch_size: int
) -> None:
    # outside_effects=False: the batch-mates before the poison wrote their effects
    # in the batch's transaction, with no savepoint, when the worker was killed.
    pill = 3
    await db.execute("CREATE TABLE effects (n int, pid int)")
    async with make_bus("billing", concurrency=0) as sender:
        for n in range(1, MESSAGES + 1):
            await sender.send(Ping(n=n), to="billing")

    lines = await _supervise(dsn, db, batch_size, pill, "pure")

    rows = await db.fetch("SELECT subqueue, error_info FROM nmbus.billing ORDER BY id")
    assert [r["subqueue"] for r in rows] == ["F" if n == pill else "X" for n in range(1, 11)]
    assert rows[pill - 1]["error_info"].startswith("AttemptsExhausted")
    written = await db.fetch("SELECT n, xmin::text AS xid FROM effects")
    effects = Counter(r["n"] for r in written)
    assert effects == Counter({n: 1 for n in range(1, MESSAGES + 1) if n != pill})
    # A handler's write inside a savepoint carries that subtransaction's own id. The
    # mates of a batch that died run again alone; with batches of 5, the second batch
    # (6-10) never held the poison and committed all of its writes under one id.
    xids = Counter(r["xid"] for r in written)
    if batch_size < MESSAGES:
        assert max(xids.values()) == batch_size, xids
    # The mates before the poison wrote in the batch that died; nothing of it stayed.
    runs = Counter(int(m.group(1)) for m in map(re.compile(r"ran (\d+) ").match, lines) if m)
    assert all(runs[n] == 2 for n in range(1, pill))


@pytest.mark.timeout(150)
async def test_a_poison_after_a_committed_part_of_its_batch_takes_only_the_rest_with_it(
    dsn: str, make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # Handlers of 0.15 s: the batch of 10 has committed its first part (at least
    # 0.5 s of handlers) when the poison, sixth, kills the worker.
    pill = 6
    await db.execute("CREATE TABLE effects (n int, pid int)")
    async with make_bus("billing", concurrency=0) as sender:
        for n in range(1, MESSAGES + 1):
            await sender.send(Ping(n=n), to="billing")

    lines = await _supervise(dsn, db, MESSAGES, pill, "slow")

    rows = await db.fetch("SELECT subqueue, retry_count FROM nmbus.billing ORDER BY id")
    assert [r["subqueue"] for r in rows] == ["F" if n == pill else "X" for n in range(1, 11)]
    effects = Counter(r["n"] for r in await db.fetch("SELECT n FROM effects"))
    assert effects == Counter({n: 1 for n in range(1, MESSAGES + 1) if n != pill})
    runs = Counter(int(m.group(1)) for m in map(re.compile(r"ran (\d+) ").match, lines) if m)
    # The committed part ran once, one attempt; the rest at most twice.
    committed = [n for n in range(1, pill) if runs[n] == 1]
    assert committed[:1] == [1]
    assert all(rows[n - 1]["retry_count"] == 1 for n in committed)
    assert max(c for n, c in runs.items() if n != pill) <= 2
    assert MAX_ATTEMPTS <= runs[pill] <= MAX_ATTEMPTS + 1


@pytest.mark.timeout(150)
async def test_concurrent_handlers_commit_their_part_before_a_poison_kills_the_worker(
    dsn: str, make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # Three handlers at once; the poison waits until a part of its batch is
    # committed (or 20 s), then kills the worker, on every attempt.
    pill = 6
    await db.execute("CREATE TABLE effects (n int, pid int)")
    async with make_bus("billing", concurrency=0) as sender:
        for n in range(1, MESSAGES + 1):
            await sender.send(Ping(n=n), to="billing")

    lines = await _supervise(dsn, db, MESSAGES, pill, "concurrent")

    rows = await db.fetch("SELECT subqueue, retry_count FROM nmbus.billing ORDER BY id")
    assert [r["subqueue"] for r in rows] == ["F" if n == pill else "X" for n in range(1, 11)]
    effects = Counter(r["n"] for r in await db.fetch("SELECT n FROM effects"))
    assert effects == Counter({n: 1 for n in range(1, MESSAGES + 1) if n != pill})
    runs = Counter(int(m.group(1)) for m in map(re.compile(r"ran (\d+) ").match, lines) if m)
    # The first commit came while the poison waited: whatever it held ran once.
    once = [n for n in range(1, MESSAGES + 1) if n != pill and runs[n] == 1]
    assert once and all(rows[n - 1]["retry_count"] == 1 for n in once)
    assert max(c for n, c in runs.items() if n != pill) <= 2
    assert MAX_ATTEMPTS <= runs[pill] <= MAX_ATTEMPTS + 1
