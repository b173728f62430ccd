"""Periodic ticks under SIGKILLs and a retention run every second: once per due time?

    python -m tests.periodic_soak postgresql://postgres@127.0.0.1:5432/postgres \
        [--seconds 40] [--kills 3]

Creates its own database (dropped at the end), starts two worker processes of
endpoint ``clock`` with ``@bus.periodic(every=1)`` (tests/delivery_workers.py),
SIGKILLs one of them every ``seconds / (kills + 1)`` seconds and starts another,
and meanwhile removes every handled tick with retention (archiving it), once a
second. Then every tick row ever stored is in the archive or the table: a due
time enqueued twice would show as two rows with the same unique id. Prints the
figures; tests/reliability/test_periodic_soak.py runs a shorter one and checks them.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pyarrow.dataset as ds

from nmbus.ports.operations import RetentionPolicy
from nmbus.postgres.retention import clean_queue
from tests.pg import with_database
from tests.procs import ROOT

TICK_ID = "nmbus.tick:beat:"  # tests/delivery_workers.py's schedule


@dataclass
class SoakResult:
    kills: int
    retention_runs: int
    archived: int
    due_times: int  # distinct due times enqueued
    rows: int  # tick rows ever stored (archived or still in the table)
    enqueued_twice: list[str]
    handled: int  # handler runs printed (a SIGKILL mid-handler may repeat one)
    gaps: int  # due times between the first and last that were never enqueued


class Worker:
    def __init__(self, dsn: str) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tests.delivery_workers", "periodic", dsn, "3600"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.strip())

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)
        self.reader.join(10)  # its output ends with the process
        if self.popen.stdout is not None:
            self.popen.stdout.close()


def archived_ids(archive: Path) -> list[str]:
    if not any(archive.rglob("*.parquet")):
        return []
    table = ds.dataset(archive, format="parquet", partitioning="hive").to_table()
    return [str(u) for u in table.column("unique_id").to_pylist()]


async def soak(dsn: str, seconds: float, kills: int, archive: Path) -> SoakResult:
    conn = await asyncpg.connect(dsn)
    workers = [Worker(dsn), Worker(dsn)]
    retired: list[Worker] = []
    # Segments a second wide, so retention drops handled ticks as it goes.
    policy = RetentionPolicy(
        max_age=timedelta(0), batch_size=100, archive_dir=archive, segment_seconds=1.0
    )
    runs = archived = killed = 0
    started = time.monotonic()
    try:
        while (elapsed := time.monotonic() - started) < seconds:
            await asyncio.sleep(1.0)
            if await conn.fetchval("SELECT to_regclass('nmbus.clock')") is not None:
                archived += (await clean_queue(conn, "nmbus", "clock", policy)).total
                runs += 1
            if killed < kills and elapsed >= seconds * (killed + 1) / (kills + 1):
                victim = workers.pop(random.randrange(len(workers)))
                victim.kill()
                retired.append(victim)
                workers.append(Worker(dsn))
                killed += 1
    finally:
        for w in workers:
            w.kill()
        retired.extend(workers)
    live = [r[0] for r in await conn.fetch("SELECT unique_id FROM nmbus.clock")]
    await conn.close()
    stored = live + await asyncio.to_thread(archived_ids, archive)
    counts = Counter(stored)
    times = sorted(datetime.fromisoformat(u.removeprefix(TICK_ID)) for u in counts)
    gaps = sum(int((b - a).total_seconds()) - 1 for a, b in itertools.pairwise(times))
    return SoakResult(
        kills=killed,
        retention_runs=runs,
        archived=archived,
        due_times=len(counts),
        rows=len(stored),
        enqueued_twice=sorted(u for u, n in counts.items() if n > 1),
        handled=sum(line.startswith("tick ") for w in retired for line in w.lines),
        gaps=gaps,
    )


async def main(args: Any) -> None:
    name = f"nmbus_soak_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(args.dsn)
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        with tempfile.TemporaryDirectory() as archive:
            result = await soak(
                with_database(args.dsn, name), args.seconds, args.kills, Path(archive)
            )
        print(result)
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dsn", help="a server DSN; a scratch database is created on it")
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--kills", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
