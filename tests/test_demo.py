"""``nmbus demo`` end to end: the services, their failures, the report, the clean-up."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from nmbus.cli.demo import bus_summary
from nmbus.demo import report as demo_report
from nmbus.demo import services as demo
from nmbus.errors import ConfigurationError

ROOT = Path(__file__).resolve().parent.parent


def _require_spark() -> None:
    """Skip, saying what is missing, when this machine cannot run the report.

    CI installs all of it and sets NMBUS_TEST_STRICT=1, which fails a run with a skip.
    """
    try:
        demo_report.check_report()
    except demo_report.ReportUnavailable as exc:
        pytest.skip(f"the report cannot run here: {exc}")


def _nmbus(*args: str, env: dict[str, str], timeout: float = 300) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "nmbus", "demo", *args, "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    outcome: dict[str, Any] = json.loads(result.stdout)
    return outcome


async def _counts(conn: asyncpg.Connection, schema: str, queue: str) -> dict[str, int]:
    rows = await conn.fetch(
        f'SELECT subqueue, count(*) FROM "{schema}"."{queue}" GROUP BY subqueue'
    )
    found = {r[0]: int(r[1]) for r in rows}
    return {sq: found.get(sq, 0) for sq in "IRXF"}


async def test_every_order_settles_and_failures_are_retried(
    dsn: str, db: asyncpg.Connection
) -> None:
    options = demo.DemoOptions(orders=150, flaky_rate=0.2, decline_rate=0.05, timeout=120)
    seen: list[demo.Snapshot] = []
    result = await demo.run_bus(dsn, options, on_progress=seen.append)

    billing = await _counts(db, "nmbus_demo", "billing")
    warehouse = await _counts(db, "nmbus_demo", "warehouse")
    notifications = await _counts(db, "nmbus_demo", "notifications")
    for counts in (billing, warehouse, notifications):
        assert counts["I"] == counts["R"] == 0
    # Every order is charged or failed once; every charge ships; both ends notify.
    assert billing["X"] + billing["F"] == 150
    assert warehouse["X"] + warehouse["F"] == billing["X"]
    assert notifications["X"] + notifications["F"] == 150 + warehouse["X"]
    # The payment row commits with the message, so there is one per charged order.
    assert await db.fetchval("SELECT count(*) FROM nmbus_demo.demo_payments") == billing["X"]
    assert result.payments == billing["X"]
    declined = await db.fetchval(
        "SELECT count(*) FROM nmbus_demo.billing WHERE subqueue = 'F' "
        "AND error_info LIKE 'PermanentError: card declined%' AND retry_count = 1"
    )
    assert declined == result.snapshot.declined > 0
    retried = await db.fetchval(
        "SELECT count(*) FROM nmbus_demo.billing WHERE subqueue = 'X' AND retry_count > 1"
    )
    assert retried > 0 and result.retried["billing"] >= retried
    # The summary under the table says what the table shows: F is declines and last attempts.
    said = bus_summary(result)
    in_f = billing["F"] + warehouse["F"] + notifications["F"]
    parts = re.search(
        r"F holds (\d+) messages?: (\d+) declined cards? \(.*?\) and (\d+) messages? whose "
        r"last attempt failed\.",
        said,
    )
    assert parts is not None, said
    assert int(parts[1]) == in_f == int(parts[2]) + int(parts[3]), said
    assert int(parts[2]) == declined
    # What the live view was given, it was given in order, ending with the outcome.
    assert seen and seen[-1].done and seen[-1].settled == 150
    assert [s.published for s in seen] == sorted(s.published for s in seen)


async def test_a_schema_that_is_not_the_demos_is_left_alone(
    dsn: str, db: asyncpg.Connection
) -> None:
    await db.execute("CREATE SCHEMA precious; CREATE TABLE precious.data (n int)")
    with pytest.raises(ConfigurationError, match="not a demo schema"):
        await demo.run_bus(dsn, demo.DemoOptions(orders=5, schema="precious"))
    with pytest.raises(ConfigurationError, match="not a demo schema"):
        await demo.drop_schema(dsn, "precious")
    assert await db.fetchval("SELECT to_regclass('precious.data') IS NOT NULL")


def _charts_drawn(html: Path, tmp_path: Path) -> int:
    """How many charts the page drew in headless Chromium (it marks <html> when done)."""
    dom = subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'chromium'}",
            "--virtual-time-budget=5000",
            "--dump-dom",
            html.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    found = re.search(r'data-charts-rendered="(-?\d+)"', dom)
    assert found, "the report's script did not finish"
    return int(found.group(1))


async def _fetch_counts(dsn: str, queue: str) -> dict[str, int]:
    conn = await asyncpg.connect(dsn)
    try:
        return await _counts(conn, "nmbus_demo", queue)
    finally:
        await conn.close()


async def _schema_exists(dsn: str) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        return bool(await conn.fetchval("SELECT to_regnamespace('nmbus_demo') IS NOT NULL"))
    finally:
        await conn.close()


@pytest.mark.spark
@pytest.mark.timeout(420)
def test_demo_command_with_a_dsn_runs_the_report(dsn: str, tmp_path: Path) -> None:
    _require_spark()
    out = tmp_path / "report"
    env = {**os.environ, "NMBUS_DSN": dsn}
    outcome = _nmbus(
        "--orders", "200", "--out", str(out), "--data-dir", str(tmp_path / ".nmbus"), env=env
    )
    bus = outcome["bus"]
    assert bus["orders"] == 200
    billing = bus["queues"]["billing"]
    assert billing["processed"] + billing["failed"] == 200
    assert "embedded" not in outcome
    assert (tmp_path / ".nmbus" / "demo.log").read_text().count('"event": "bus_started"') == 4

    report = outcome["report"]
    html = Path(report["html"])
    assert all(f"{q}" in html.read_text() for q in demo.QUEUES)
    # Drawn in a real headless Chromium; without one the test skips at its end
    # (a skip, which CI turns into a failure, never a silent pass).
    charts = _charts_drawn(html, tmp_path) if shutil.which("chromium") else None
    summary = json.loads(Path(report["json"]).read_text())
    by_queue = {q["queue"]: q for q in summary["queues"]}
    for queue in demo.QUEUES:
        counts = asyncio.run(_fetch_counts(dsn, queue))
        assert by_queue[queue]["processed"] == counts["X"]
        assert by_queue[queue]["failed"] == counts["F"]

    cleaned = subprocess.run(
        [
            sys.executable,
            "-m",
            "nmbus",
            "demo",
            "--clean",
            "--out",
            str(out),
            "--data-dir",
            str(tmp_path / ".nmbus"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "schema nmbus_demo dropped" in cleaned.stdout
    assert not asyncio.run(_schema_exists(dsn))
    assert not out.exists()
    assert not (tmp_path / ".nmbus").exists()  # its logs and the folder are gone too
    if charts is None:
        pytest.skip(
            "the report's charts were not checked: needs chromium (apt-get install chromium)"
        )
    assert charts > 0


@pytest.mark.timeout(240)
def test_demo_without_pyspark_runs_the_bus_and_says_what_the_report_needs(
    dsn: str, tmp_path: Path
) -> None:
    hidden = tmp_path / "nopyspark"
    hidden.mkdir()
    (hidden / "pyspark.py").write_text('raise ImportError("pyspark is hidden by this test")\n')
    env = {**os.environ, "NMBUS_DSN": dsn, "PYTHONPATH": str(hidden)}
    outcome = _nmbus("--orders", "20", "--data-dir", str(tmp_path / ".nmbus"), env=env)
    assert outcome["bus"]["orders"] == 20
    assert outcome["report"] == {"skipped": demo_report.SPARK_HINT}


def test_a_database_that_is_not_there_is_one_line_before_any_progress(
    dsn: str, tmp_path: Path
) -> None:
    missing = dsn.rsplit("/", 1)[0] + "/nmbus_no_such_database"
    run = subprocess.run(
        [sys.executable, "-m", "nmbus", "demo", "--orders", "5", "--data-dir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "NMBUS_DSN": missing, "COLUMNS": "80"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # as a terminal shows them: one stream
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stdout
    errors = [line for line in run.stdout.splitlines() if "error:" in line]
    assert errors == ['error: the database said: database "nmbus_no_such_database" does not exist']
    assert "orders published" not in run.stdout  # no progress drawn for a run that cannot start


def test_without_the_embedded_extra_and_a_dsn_the_demo_says_so_first(tmp_path: Path) -> None:
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    for name in ("pgserver", "pyspark"):
        (hidden / f"{name}.py").write_text(f'raise ImportError("{name} is hidden by this test")\n')
    env = {k: v for k, v in os.environ.items() if k != "NMBUS_DSN"}
    run = subprocess.run(
        [sys.executable, "-m", "nmbus", "demo", "--orders", "5", "--data-dir", str(tmp_path)],
        cwd=ROOT,
        env={**env, "PYTHONPATH": os.pathsep.join([str(hidden), str(ROOT)])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stdout == "", run.stdout  # nothing about a report of a run that cannot start
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no NMBUS_DSN is set"), run.stderr
    assert "pip install 'nmbus[embedded]'" in lines[0]


@pytest.mark.timeout(240)
def test_demo_names_the_server_of_its_dsn_and_clean_leaves_no_folder(
    dsn: str, tmp_path: Path
) -> None:
    # The test server trusts local connections, so a password is accepted and ignored.
    secret = "s3cret-do-not-print"
    with_password = dsn.replace("postgresql://postgres@", f"postgresql://postgres:{secret}@", 1)
    assert secret in with_password
    database = dsn.rsplit("/", 1)[1]
    data_dir = tmp_path / ".nmbus"
    env = {**os.environ, "NMBUS_DSN": with_password, "COLUMNS": "80"}
    argv = [sys.executable, "-m", "nmbus", "demo", "--orders", "30", "--no-report"]
    run = subprocess.run(
        [*argv, "--data-dir", str(data_dir), "--out", str(tmp_path / "report")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    said = " ".join(run.stdout.split())
    assert f"PostgreSQL server (--dsn / NMBUS_DSN): 127.0.0.1:5432/{database}" in said
    assert secret not in run.stdout + run.stderr
    # Every line of the live view and the tables fits 80 columns, names whole.
    assert all(len(line) <= 80 for line in run.stdout.splitlines()), run.stdout
    assert re.search(r"^notifications\s", run.stdout, re.MULTILINE), run.stdout
    assert (data_dir / "demo.log").exists()
    outcome = _nmbus("--orders", "10", "--no-report", "--data-dir", str(data_dir), env=env)
    assert outcome["server"] == f"127.0.0.1:5432/{database}"
    assert secret not in json.dumps(outcome) and "postgres:***@" in outcome["dsn"]

    # --clean drops the schema, removes the logs and the folder they were in.
    clean = [*argv[:4], "--clean", "--data-dir", str(data_dir), "--out", str(tmp_path / "r")]
    cleaned = subprocess.run(clean, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert cleaned.returncode == 0, cleaned.stderr
    assert f"dropped on 127.0.0.1:5432/{database}" in " ".join(cleaned.stdout.split())
    assert secret not in cleaned.stdout + cleaned.stderr
    assert not data_dir.exists()
    assert not asyncio.run(_schema_exists(dsn))
    # A folder that also holds an embedded server keeps it (and says how to remove it).
    (data_dir / "pgdata").mkdir(parents=True)
    (data_dir / "demo.log").write_text("{}\n")
    again = subprocess.run(clean, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stderr
    assert not (data_dir / "demo.log").exists() and (data_dir / "pgdata").is_dir()
    assert "holds an embedded PostgreSQL" in " ".join(again.stdout.split())


def test_clean_names_the_shared_class_cache_and_keeps_it(dsn: str, tmp_path: Path) -> None:
    folder = tmp_path / "spark-classes"
    folder.mkdir(mode=0o700)
    archive = folder / "spark-0123456789abcdef-3000000.jsa"
    archive.write_bytes(b"\0" * 3_000_000)
    env = {**os.environ, "NMBUS_DSN": dsn, "NMBUS_SPARK_CLASS_CACHE": str(folder)}
    clean = [sys.executable, "-m", "nmbus", "demo", "--clean"]
    where = ["--data-dir", str(tmp_path / ".nmbus"), "--out", str(tmp_path / "r")]
    done = subprocess.run(
        [*clean, *where], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stdout.split())
    assert f"kept Spark's class cache {folder} (3 MB, 1 archive(s))" in said, said
    assert f"rm -r {folder}" in said
    assert archive.exists()  # shared with other projects' reports: named, not removed
    off = subprocess.run(
        [*clean, *where],
        cwd=ROOT, env={**env, "NMBUS_SPARK_CLASS_CACHE": "off"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert off.returncode == 0 and "class cache" not in off.stdout, off.stdout


@pytest.mark.timeout(240)
def test_demo_without_a_dsn_uses_the_embedded_server(tmp_path: Path) -> None:
    if importlib.util.find_spec("pgserver") is None:
        pytest.fail("the embedded extra (pgserver) is not installed: pip install -e '.[embedded]'")
    data_dir = tmp_path / ".nmbus"
    env = {k: v for k, v in os.environ.items() if k != "NMBUS_DSN"}
    argv = ["demo", "--orders", "60", "--no-report", "--data-dir", str(data_dir), "--json"]
    first = subprocess.run(
        [sys.executable, "-m", "nmbus", *argv],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    outcome = json.loads(first.stdout)
    said = " ".join(first.stderr.split())
    if os.geteuid() == 0:
        # Root changes the machine: the terminal says so, not only the log file.
        assert "as root: the embedded PostgreSQL runs as the system user pgserver" in said
        assert f"gave {data_dir.resolve() / 'pgdata'} to pgserver" in said, said
    else:
        assert "as root" not in said and "pgserver" not in said, said
    assert outcome["dsn"].startswith("postgresql://postgres@127.0.0.1:")
    assert outcome["bus"]["queues"]["billing"]["processed"] > 0
    assert outcome["embedded"] == "stopped"
    assert not (data_dir / "pgdata" / "postmaster.pid").exists()
    # A second run starts the same folder again, on the same port when it is free.
    again = _nmbus("--orders", "20", "--no-report", "--data-dir", str(data_dir), env=env)
    assert again["bus"]["orders"] == 20
    subprocess.run(
        [
            sys.executable,
            "-m",
            "nmbus",
            "demo",
            "--clean",
            "--data-dir",
            str(data_dir),
            "--out",
            str(tmp_path / "report"),
        ],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert not data_dir.exists()


def test_options_that_would_hang_or_make_no_sense_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="--concurrency must be at least 1"):
        demo.DemoOptions(concurrency=0).check()  # no worker loop: it would wait for ever
    with pytest.raises(ConfigurationError, match="--flaky-rate must be at least 0 and below 1"):
        demo.DemoOptions(flaky_rate=1.5).check()
    for argv in (["--concurrency", "0"], ["--orders", "0"]):
        result = subprocess.run(
            [sys.executable, "-m", "nmbus", "demo", *argv, "--no-report"],
            cwd=ROOT,
            env={**os.environ, "NMBUS_DSN": "postgresql://nobody@127.0.0.1:1/none"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("error: Invalid value for") and argv[0] in result.stderr
