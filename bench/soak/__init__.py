"""The kill soak: many messages, flaky handlers, worker processes SIGKILLed at random.

``run_soak`` sends ``messages`` messages to a queue of its own schema
(``nmbus_soak`` by default, dropped and recreated at the start), starts
``workers`` worker processes (:mod:`bench.soak.worker`) and SIGKILLs
one of them every ``kill_every`` seconds, starting a new one at once. Handlers
fail ``fail_rate`` of the time and sometimes sleep. ``poison`` of the messages
are poison: their handler SIGKILLs its own process every time; a dead worker is
restarted at once, as a process manager would. Each poison message must end in
F (AttemptsExhausted) and no other message may be failed for dying.

Each handler, before it may fail, writes ``(unique_id, attempt, pid)`` to
``soak_effects`` through ``ctx.connection`` (transactional: it must exist once
for every message in X and never for one in F), and after succeeding appends
``ok unique_id attempt`` to a per-process log file with an unbuffered
``O_APPEND`` write (not transactional: it survives the SIGKILL of its process).
A message with two ``ok`` lines was handled twice; every such repeat must come
from a process that was killed, whose transaction never committed.

At the end every message must be in X or F, none left in I or R, none lost
(:mod:`bench.soak.report` checks it all).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import asyncpg

from bench.soak.report import SoakReport, verify
from bench.soak.worker import ENTRY, QUEUE, SoakWork
from bench.sql import render
from nmbus.bus import Bus
from nmbus.envelopes import NO_OPTIONS
from nmbus.settings import Settings


def _worker_env() -> dict[str, str]:
    # The workers import bench/ from this repository, and its nmbus first when it has one.
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


class _Proc:
    def __init__(self, args: list[str], stderr: Path) -> None:
        self._err = stderr.open("ab")
        self.popen = subprocess.Popen(
            # `-c` with ENTRY, not `-m`: see bench.soak.worker.
            [sys.executable, "-c", ENTRY, "worker", *args],
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            env=_worker_env(),
        )
        self.pid = self.popen.pid

    async def ready(self, timeout: float = 60.0) -> None:
        assert self.popen.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.popen.stdout.readline), timeout)
        if not line.startswith("ready"):
            raise RuntimeError(f"soak worker {self.pid} exited before it was ready")

    def exited(self) -> bool:
        return self.popen.poll() is not None

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)
        self._close()

    def terminate(self, timeout: float) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
        self._close()

    def _close(self) -> None:
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        self._err.close()


async def run_soak(
    dsn: str,
    messages: int = 20_000,
    *,
    workers: int = 2,
    kill_every: float = 3.0,
    fail_rate: float = 0.1,
    sleep_rate: float = 0.01,
    sleep_max: float = 0.2,
    lease: float = 2.0,
    batch_size: int = 50,
    concurrency: int = 2,
    max_attempts: int = 5,
    poison: int = 0,
    schema: str = "nmbus_soak",
    timeout: float = 600.0,
    log_dir: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SoakReport:
    """Run a kill soak against the database at ``dsn`` and report what it found."""
    if messages < 1 or workers < 1:
        raise ValueError("a soak needs at least one message and one worker")
    if not 0 <= poison <= messages:
        raise ValueError("poison must be between 0 and the number of messages")
    report = SoakReport(messages=messages, workers=workers, poison_messages=poison)
    owned_dir = log_dir is None
    logs = Path(tempfile.mkdtemp(prefix="nmbus-soak-")) if log_dir is None else log_dir
    logs.mkdir(parents=True, exist_ok=True)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(render("drop_schema", schema))
        settings = Settings(dsn=dsn, schema_name=schema, concurrency=0)
        sender = Bus("soak-sender", settings=settings)
        async with sender:
            await sender.store.ensure_queue(QUEUE)
            await conn.execute(render("soak_create_effects", schema))
            args = [
                dsn,
                schema,
                str(logs),
                *(
                    f"{k}={v}"
                    for k, v in {
                        "fail_rate": fail_rate,
                        "sleep_rate": sleep_rate,
                        "sleep_max": sleep_max,
                        "lease": lease,
                        "batch_size": batch_size,
                        "concurrency": concurrency,
                        "max_attempts": max_attempts,
                    }.items()
                ),
            ]
            started = time.monotonic()
            procs = [_Proc(args, logs / "workers.err") for _ in range(workers)]
            try:
                await asyncio.gather(*(p.ready() for p in procs))
                sent, poisoned = await _send_all(sender, messages, poison)
                report.lost = messages - len(sent)
                await _kill_until_done(
                    conn, schema, procs, args, logs, kill_every, timeout, report, progress
                )
            finally:
                for proc in procs:
                    proc.terminate(timeout=30)
            report.seconds = time.monotonic() - started
        await verify(conn, schema, logs, report, poisoned)
    finally:
        await conn.close()
        if owned_dir:
            import shutil

            shutil.rmtree(logs, ignore_errors=True)
    return report


async def _send_all(sender: Bus, messages: int, poison: int) -> tuple[set[str], set[str]]:
    """Send the work; returns the unique ids stored, and those of the poison messages."""
    pills = set(random.sample(range(messages), poison))
    sent: set[str] = set()
    poisoned: set[str] = set()
    chunk = 1000
    for start in range(0, messages, chunk):
        envelopes = []
        for n in range(start, min(messages, start + chunk)):
            envelope = sender.envelopes.build(SoakWork(n=n, poison=n in pills), NO_OPTIONS)
            envelopes.append(envelope)
            if n in pills:
                poisoned.add(envelope.unique_id)
        await sender.store.insert(QUEUE, sender.endpoint, envelopes)
        sent.update(e.unique_id for e in envelopes)
    return sent, poisoned


async def _kill_until_done(
    conn: asyncpg.Connection,
    schema: str,
    procs: list[_Proc],
    args: list[str],
    logs: Path,
    kill_every: float,
    timeout: float,
    report: SoakReport,
    progress: Callable[[int, int], None] | None,
) -> None:
    deadline = time.monotonic() + timeout
    next_kill = time.monotonic() + kill_every * random.uniform(0.5, 1.5)
    open_rows = render("soak_open_rows", schema, QUEUE)
    while time.monotonic() < deadline:
        remaining = int(await conn.fetchval(open_rows))
        if progress is not None:
            progress(report.messages - remaining, report.messages)
        if remaining == 0:
            return
        for index, proc in enumerate(procs):
            if proc.exited():
                # Killed by what it handled: restart it, as a process manager would.
                report.deaths += 1
                report.killed_pids.append(proc.pid)
                proc.kill()  # reaps it and closes its pipes
                procs[index] = _Proc(args, logs / "workers.err")
                await procs[index].ready()
        if time.monotonic() >= next_kill:
            victim = procs[0]
            victim.kill()
            report.kills += 1
            report.killed_pids.append(victim.pid)
            procs[0] = _Proc(args, logs / "workers.err")
            await procs[0].ready()
            next_kill = time.monotonic() + kill_every * random.uniform(0.5, 1.5)
        await asyncio.sleep(0.2)
