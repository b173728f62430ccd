"""The kill soak: many messages, flaky handlers, worker processes SIGKILLed at random.

``run_soak`` sends ``messages`` messages to a queue of its own schema
(``nmbus_soak`` by default, dropped and recreated at the start), starts
``workers`` worker processes (``nmbus.tools.soak._main``) and SIGKILLs
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

At the end every message must be in X or F, none left in I or R, none lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from nmbus.bus import Bus
from nmbus.context import Context
from nmbus.messages import Message
from nmbus.settings import Settings
from nmbus.tools.sql import render

QUEUE = "soak"


class SoakWork(Message, type_name="nmbus.soak.Work"):
    """One unit of soak work."""

    n: int
    poison: bool = False


class SoakFailure(Exception):
    """The soak handler's injected failure."""


@dataclass
class SoakReport:
    """What a soak run found. ``ok`` is the verdict."""

    messages: int
    workers: int
    seconds: float = 0.0
    kills: int = 0
    killed_pids: list[int] = field(default_factory=list)
    poison_messages: int = 0
    deaths: int = 0  # workers that died on their own (a poison message killed them)
    poison_failed: int = 0  # poison messages in F with AttemptsExhausted: must be all
    innocent_exhausted: int = 0  # must be 0: other messages failed for dying
    processed: int = 0  # X
    failed: int = 0  # F
    open: int = 0  # still I or R at the end
    lost: int = 0  # sent but not stored
    attempts: int = 0  # sum of retry_count
    injected_failures: int = 0
    handled_twice: int = 0  # messages with more than one successful handler run
    repeats_from_killed: int = 0
    repeats_from_live: int = 0  # must be 0: a repeat whose process was not killed
    effects_duplicated: int = 0  # must be 0: a transactional effect committed twice
    effects_missing: int = 0  # must be 0: a message in X without its effect
    effects_in_failed: int = 0  # must be 0: a message in F with a committed effect
    failed_reasons: dict[str, int] = field(default_factory=dict)
    worker_events: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (
            self.processed + self.failed == self.messages
            and self.open == 0
            and self.lost == 0
            and self.repeats_from_live == 0
            and self.effects_duplicated == 0
            and self.effects_missing == 0
            and self.effects_in_failed == 0
            and self.poison_failed == self.poison_messages
            and self.innocent_exhausted == 0
        )

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok, "rate": round(self.rate, 1)}


# -- the worker process ---------------------------------------------------------------


async def _worker(dsn: str, schema: str, logs: Path, options: dict[str, float]) -> None:
    pid = os.getpid()
    fd = os.open(logs / f"{pid}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    fail_rate, sleep_rate, sleep_max = (
        options["fail_rate"],
        options["sleep_rate"],
        options["sleep_max"],
    )
    bus = Bus(
        QUEUE,
        settings=Settings(
            dsn=dsn,
            schema_name=schema,
            concurrency=int(options["concurrency"]),
            batch_size=int(options["batch_size"]),
            lease_seconds=options["lease"],
            poll_interval=0.5,
            max_attempts=int(options["max_attempts"]),
            retry_delay=0.05,
            retry_max_delay=0.5,
            reconnect_max_delay=1.0,
        ),
    )
    record = render("soak_record_effect", schema)

    @bus.handler
    async def handle(msg: SoakWork, ctx: Context) -> None:
        if msg.poison:
            os.write(fd, f"poison {ctx.unique_id} {ctx.retry_count}\n".encode())
            os.kill(pid, signal.SIGKILL)
        if random.random() < sleep_rate:
            await asyncio.sleep(random.uniform(0, sleep_max))
        await ctx.connection.execute(record, ctx.unique_id, ctx.retry_count, pid)
        if random.random() < fail_rate:
            os.write(fd, f"fail {ctx.unique_id} {ctx.retry_count}\n".encode())
            raise SoakFailure(f"injected failure of message {msg.n}")
        os.write(fd, f"ok {ctx.unique_id} {ctx.retry_count}\n".encode())

    loop = asyncio.get_running_loop()
    async with bus:
        loop.add_signal_handler(signal.SIGTERM, lambda: asyncio.ensure_future(bus.stop()))
        print("ready", flush=True)
        await bus.wait_stopped()


def _configure_worker_logging() -> None:
    import logging

    import structlog

    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


# -- the run -------------------------------------------------------------------------------


_WORKER_ENTRY = "import sys; from nmbus.tools.soak import _main; _main(sys.argv[1:])"


def _worker_env() -> dict[str, str]:
    # The workers must run this very nmbus, wherever it was imported from.
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


class _Proc:
    def __init__(self, args: list[str], stderr: Path) -> None:
        self._err = stderr.open("ab")
        self.popen = subprocess.Popen(
            # Not `-m nmbus.tools.soak`: that would define SoakWork a second time, in __main__.
            [sys.executable, "-c", _WORKER_ENTRY, "worker", *args],
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
        await _verify(conn, schema, logs, report, poisoned)
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
            envelope = sender.envelopes.build(SoakWork(n=n, poison=n in pills), None, None, None)
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


def _read_logs(logs: Path) -> tuple[dict[str, list[tuple[int, int]]], int]:
    """Successful runs per unique id as (attempt, pid), and the injected failures."""
    runs: dict[str, list[tuple[int, int]]] = {}
    failures = 0
    for path in logs.glob("*.log"):
        pid = int(path.stem)
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != 3:
                continue  # one write() per line: a SIGKILL cannot cut one short
            if parts[0] == "ok":
                runs.setdefault(parts[1], []).append((int(parts[2]), pid))
            elif parts[0] == "fail":
                failures += 1
    return runs, failures


async def _verify(
    conn: asyncpg.Connection, schema: str, logs: Path, report: SoakReport, poisoned: set[str]
) -> None:
    rows = await conn.fetch(render("soak_rows", schema, QUEUE))
    runs, report.injected_failures = _read_logs(logs)
    killed = set(report.killed_pids)
    reasons: Counter[str] = Counter()
    stored = 0
    for unique_id, subqueue, retry_count, reason, attempts, pids in rows:
        stored += 1
        report.attempts += retry_count
        committed = set(zip(attempts, pids, strict=True))
        if subqueue == "X":
            report.processed += 1
            if len(attempts) > 1:
                report.effects_duplicated += 1
            elif not attempts:
                report.effects_missing += 1
        elif subqueue == "F":
            report.failed += 1
            reason_name = (reason or "").split(":")[0]
            reasons[reason_name] += 1
            if reason_name == "AttemptsExhausted":
                if unique_id in poisoned:
                    report.poison_failed += 1
                else:
                    report.innocent_exhausted += 1
            if attempts:
                report.effects_in_failed += 1
        else:
            report.open += 1
        done = runs.get(unique_id, [])
        if len(done) > 1:
            report.handled_twice += 1
        for run, count in Counter(done).items():
            # The same attempt run twice by one process is a re-run inside a live
            # worker (a batch rolled back and retried), never excused by a kill.
            report.repeats_from_live += count - 1
            if run in committed:
                continue
            if run[1] in killed:
                report.repeats_from_killed += 1
            else:
                report.repeats_from_live += 1
    report.lost = max(report.lost, report.messages - stored)
    report.failed_reasons = dict(reasons)
    report.worker_events = _worker_events(logs / "workers.err")


def _worker_events(path: Path) -> dict[str, int]:
    """Warning and error events the workers logged, by name (retries left out)."""
    events: Counter[str] = Counter()
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[2] in ("[warning", "[error", "[critical"):
                events[parts[4] if parts[3] == "]" else parts[3]] += 1
    events.pop("message_retry_scheduled", None)
    return dict(events)


# -- entry point of the worker processes ---------------------------------------------------


def _main(argv: list[str]) -> None:
    if not argv or argv[0] != "worker":
        raise SystemExit("usage: python -m nmbus.tools.soak worker DSN SCHEMA LOG_DIR key=value...")
    dsn, schema, logs = argv[1], argv[2], Path(argv[3])
    options = {k: float(v) for k, v in (item.split("=", 1) for item in argv[4:])}
    _configure_worker_logging()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_worker(dsn, schema, logs, options))
