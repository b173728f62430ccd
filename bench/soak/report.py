"""What a kill soak found: the rows, the effects and the workers' logs, checked.

The verdict (:attr:`SoakReport.ok`) needs every message in X or F and none
lost; no transactional effect committed twice, missing for a message in X, or
present for one in F; every repeat of a successful run excused by a SIGKILL;
and each poison message, and only those, failed for dying.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from bench.soak.worker import QUEUE
from bench.sql import render


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


async def verify(
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
