"""`nmbus worker module:bus` as a real process, stopped by a real signal."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

from nmbus import Bus
from tests.messages import Ping

ROOT = Path(__file__).resolve().parent.parent


def start(dsn: str, target: str, *options: str) -> subprocess.Popen[str]:
    """``nmbus [global options] worker target``."""
    env = {**os.environ, "NMBUS_DSN": dsn}
    return subprocess.Popen(
        [sys.executable, "-m", "nmbus", *options, "worker", target],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def read_until(proc: subprocess.Popen[str], prefix: str, timeout: float = 60) -> None:
    assert proc.stdout is not None
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout):
        while True:
            line = await loop.run_in_executor(None, proc.stdout.readline)
            if not line:
                raise AssertionError(f"worker exited before printing {prefix!r}")
            if line.startswith(prefix):
                return


@pytest.mark.parametrize(
    ("signum", "target"),
    [(signal.SIGTERM, "tests.cli_app:bus"), (signal.SIGINT, "tests.cli_app:make_bus")],
)
async def test_signal_stops_gracefully(
    dsn: str, db: asyncpg.Connection, signum: int, target: str
) -> None:
    async with Bus("sender", dsn=dsn, concurrency=0) as sender:
        for n in range(3):
            await sender.send(Ping(n=n), to="clitest")
    proc = start(dsn, target)
    try:
        await read_until(proc, "started 0")  # one batch of 3 claimed, the first in hand
        proc.send_signal(signum)
        code = await asyncio.to_thread(proc.wait, 60)
        out, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, err
    assert "finished 0" in out  # the in-flight handler ran to its end
    assert "started 1" not in out  # nothing new was started
    assert "shutdown_requested" in err and "bus_stopped" in err
    rows = await db.fetch(
        "SELECT subqueue, retry_count, handling_client_id, lease_expires "
        "FROM nmbus.clitest ORDER BY id"
    )
    assert tuple(rows[0]) == ("X", 1, None, None)
    # Claimed but never started: back to I at once, the attempt not counted.
    assert [tuple(r) for r in rows[1:]] == [("I", 0, None, None)] * 2


async def test_bad_target_exits_1(dsn: str) -> None:
    for target in ("tests.cli_app", "tests.no_such_module:bus", "tests.cli_app:nothing",
                   "tests.messages:Ping"):  # fmt: skip
        proc = start(dsn, target)
        _, err = await asyncio.to_thread(proc.communicate, None, 60)
        assert proc.returncode in (1, 2), (target, err)
        assert "error" in err.lower(), err


@pytest.mark.parametrize(
    ("options", "debug_shown"),
    [(("--log-format", "json"), False), (("--log-format", "json", "--log-level", "debug"), True)],
)
async def test_global_log_options_reach_the_worker(
    dsn: str, options: tuple[str, ...], debug_shown: bool
) -> None:
    async with Bus("sender", dsn=dsn, concurrency=0) as sender:
        await sender.send(Ping(n=0), to="clitest")
    with start(dsn, "tests.cli_app:bus", *options) as proc:  # closes its pipes at the end
        try:
            await read_until(proc, "finished 0")
            proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.to_thread(proc.communicate, None, 60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err
    events = [json.loads(line) for line in err.splitlines()]  # every line is JSON
    names = [e["event"] for e in events]
    assert {"worker_ready", "shutdown_requested", "bus_stopped"} <= set(names), names
    # A worker logs at info by default: per-message lines are debug, and hidden.
    assert ("message_handled" in names) is debug_shown, names
