"""SIGTERM during a drain: in-flight handlers finish, nothing stays claimed."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import asyncpg
import pytest

from nmbus import Bus
from tests.messages import Ping
from tests.waits import wait_until

pytestmark = pytest.mark.reliability

ROOT = Path(__file__).resolve().parents[2]


def _start(dsn: str, logfile: Path, seconds: float, timeout: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.reliability.sigterm_worker",
            dsn,
            str(logfile),
            str(seconds),
            str(timeout),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc


async def _ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
    assert line.startswith("ready"), line


def _end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def _log(logfile: Path) -> tuple[set[int], set[int]]:
    started, ended = set(), set()
    for line in logfile.read_text().splitlines():
        what, n = line.split()
        (started if what == "start" else ended).add(int(n))
    return started, ended


async def _fill(dsn: str, count: int) -> None:
    async with Bus("orders", dsn=dsn, concurrency=0) as sender:
        await sender.store.ensure_queue("billing")
        for n in range(count):
            await sender.send(Ping(n=n), to="billing")


async def test_sigterm_during_a_drain_finishes_in_flight_work(
    dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    await db.execute("CREATE TABLE effects (n int NOT NULL)")
    await _fill(dsn, 400)
    logfile = tmp_path / "handlers.log"
    proc = _start(dsn, logfile, seconds=0.05, timeout=20)
    try:
        await _ready(proc)
        await wait_until(
            "SELECT count(*) FROM nmbus.billing WHERE subqueue = 'X'",
            db=db,
            until=lambda done: done >= 40,
            timeout=60,
        )
        started_before, _ = _log(logfile)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 30)
        took = time.monotonic() - t0
    finally:
        _end(proc)
    assert code == 0
    assert took < 20 + 5  # within the shutdown timeout, with room for a loaded machine
    started, ended = _log(logfile)
    assert started == ended  # every handler that started, finished
    assert started_before <= started
    rows = await db.fetch("SELECT * FROM nmbus.billing ORDER BY id")
    assert [r for r in rows if r["handling_client_id"] or r["lease_expires"]] == []
    done = {int(r["msg_text"][5:-1]) for r in rows if r["subqueue"] == "X"}
    assert done == ended  # finished handlers were committed...
    effects = [r["n"] for r in await db.fetch("SELECT n FROM effects")]
    assert sorted(effects) == sorted(done)  # ...with their effects, once each
    rest = [r for r in rows if r["subqueue"] != "X"]
    assert rest, "the drain should still have been going"
    # Claimed but never started: back to I at once, the attempt not counted.
    assert {(r["subqueue"], r["retry_count"]) for r in rest} == {("I", 0)}


async def test_sigterm_with_a_hung_handler_gives_up_at_the_timeout(
    dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    await db.execute("CREATE TABLE effects (n int NOT NULL)")
    await _fill(dsn, 30)
    logfile = tmp_path / "handlers.log"
    proc = _start(dsn, logfile, seconds=3600, timeout=1.0)
    try:
        await _ready(proc)
        await wait_until(lambda: len(_log(logfile)[0]), until=lambda started: started >= 2)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 30)
        took = time.monotonic() - t0
    finally:
        _end(proc)
    assert code == 0
    assert took < 15
    started, ended = _log(logfile)
    assert ended == set()
    rows = await db.fetch("SELECT * FROM nmbus.billing ORDER BY id")
    assert [r for r in rows if r["handling_client_id"] or r["lease_expires"]] == []
    assert {r["subqueue"] for r in rows} == {"I"}
    assert await db.fetchval("SELECT count(*) FROM effects") == 0
    # The hung ones did start, so their attempt counts; their batch-mates that
    # never started are freed with the attempt refunded.
    counted = {int(r["msg_text"][5:-1]) for r in rows if r["retry_count"] == 1}
    assert counted == started
    assert {r["retry_count"] for r in rows} <= {0, 1}
