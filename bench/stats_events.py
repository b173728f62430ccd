"""Where a statistics run spends its time, from Spark's own event log.

    python -m bench.stats_events /tmp/nmbus-events/local-1700000000000

Spark writes one JSON event per line when ``spark.eventLog.enabled`` is true
(``python -m bench.stats --event-log DIR`` sets it). This reads
such a file and prints the application's start-up, every job (its call site,
wall time, stages and tasks) and the time between jobs, which is the driver's
own work (planning, Python, collecting, writing the report).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Job:
    id: int
    start: int  # milliseconds since the epoch, as Spark writes them
    end: int = 0
    site: str = ""
    stages: int = 0
    tasks: int = 0

    @property
    def ms(self) -> int:
        return max(0, self.end - self.start)


@dataclass
class Timeline:
    app_start: int = 0
    app_end: int = 0
    jobs: list[Job] = field(default_factory=list)
    executor_added: int = 0

    @property
    def job_ms(self) -> int:
        return sum(j.ms for j in self.jobs)


def _lines(path: Path) -> Iterator[str]:
    """A file of events, or a rolling log's folder (``eventlog_v2_*``) of ``events_*`` files."""
    if path.is_file():
        files = [path]
    else:
        files = sorted(path.glob("events_*"), key=lambda f: int(f.name.split("_")[1]))
    for f in files:
        with f.open(encoding="utf-8") as fh:
            yield from fh


def read(path: Path) -> Timeline:
    """The jobs of one event log (uncompressed, as Spark writes it by default)."""
    tl = Timeline()
    jobs: dict[int, Job] = {}
    for line in _lines(path):
        ev: dict[str, Any] = json.loads(line)
        kind = ev.get("Event")
        if kind == "SparkListenerApplicationStart":
            tl.app_start = int(ev["Timestamp"])
        elif kind == "SparkListenerApplicationEnd":
            tl.app_end = int(ev["Timestamp"])
        elif kind == "SparkListenerExecutorAdded" and not tl.executor_added:
            tl.executor_added = int(ev["Timestamp"])
        elif kind == "SparkListenerJobStart":
            props = ev.get("Properties") or {}
            stages = ev.get("Stage Infos") or []
            jobs[ev["Job ID"]] = Job(
                id=int(ev["Job ID"]),
                start=int(ev["Submission Time"]),
                site=str(props.get("callSite.short") or ""),
                stages=len(stages),
                tasks=sum(int(s.get("Number of Tasks", 0)) for s in stages),
            )
        elif kind == "SparkListenerJobEnd" and ev["Job ID"] in jobs:
            jobs[ev["Job ID"]].end = int(ev["Completion Time"])
    tl.jobs = sorted(jobs.values(), key=lambda j: j.start)
    return tl


def report(tl: Timeline) -> str:
    lines = []
    if tl.jobs:
        first, last = tl.jobs[0].start, max(j.end for j in tl.jobs)
        lines.append(
            f"{len(tl.jobs)} jobs, {tl.job_ms / 1000:.2f}s inside jobs; "
            f"first job {(first - tl.app_start) / 1000:.2f}s after the application started, "
            f"last ends {(last - tl.app_start) / 1000:.2f}s after it"
        )
    prev = tl.app_start
    for j in tl.jobs:
        gap = (j.start - prev) / 1000
        lines.append(
            f"  +{gap:6.2f}s gap  job {j.id:3d} {j.ms / 1000:6.2f}s  "
            f"{j.stages} stage(s) {j.tasks:4d} task(s)  {j.site}"
        )
        prev = max(prev, j.end)
    if tl.app_end:
        lines.append(f"  +{(tl.app_end - prev) / 1000:6.2f}s after the last job, to the stop")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stats_events", description=__doc__)
    p.add_argument("path", type=Path, help="an event log file, or a directory of them (newest)")
    args = p.parse_args(argv)
    path: Path = args.path
    if path.is_dir() and not path.name.startswith("eventlog_v2_"):
        files = sorted(path.iterdir(), key=lambda f: f.stat().st_mtime)
        if not files:
            print(f"no event log in {path}", file=sys.stderr)
            return 2
        path = files[-1]
    print(report(read(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
