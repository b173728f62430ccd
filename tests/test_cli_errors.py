"""The command line fails on one line: no tracebacks (unless --debug), no writes from reads.

Every case runs the real CLI: in this process through the same entry point as
the `nmbus` script, or as a process of its own where the environment must
differ (a missing pyspark, a worker).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
import structlog
from typer.testing import CliRunner, Result

from nmbus.cli import app

ROOT = Path(__file__).resolve().parent.parent
SECRET = "s3cretPW"
DOWN = "postgresql://postgres@127.0.0.1:1/nmbus_down"  # nothing listens on port 1

runner = CliRunner()


@pytest.fixture(autouse=True)
def _keep_logging_config() -> Iterator[None]:
    """The CLI configures structlog for the process; give other tests theirs back."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def invoke(*argv: str, env: dict[str, str | None] | None = None) -> Result:
    # 80 columns: an error line must not be wrapped by the terminal width either.
    base = {"COLUMNS": "80", "NMBUS_DSN": None, "NMBUS_DASHBOARD_TOKEN": None}
    return runner.invoke(app, list(argv), env={**base, **(env or {})})


def nmbus(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "NMBUS_DSN"}
    return subprocess.run(
        [sys.executable, "-m", "nmbus", *argv],
        cwd=ROOT,
        env={**base, "COLUMNS": "80", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line_error(stderr: str, code: int, expected_code: int, *needles: str) -> str:
    """Assert that stderr is exactly one error line (and the exit code); return that line."""
    lines = stderr.splitlines()
    assert code == expected_code, (code, stderr)
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    (line,) = lines
    assert line.startswith("error: "), line
    for needle in needles:
        assert needle.lower() in line.lower(), (needle, line)
    assert SECRET not in stderr
    return line


# -- defect 10: one line, whatever went wrong ------------------------------------------------


@pytest.mark.parametrize(
    ("dsn", "needle"),
    [
        (f"postgresql://postgres:{SECRET}@127.0.0.1:99999/x", "port"),
        (f"mysql://postgres:{SECRET}@127.0.0.1/x", "scheme"),
        (f"postgresql://postgres:{SECRET}@127.0.0.1/x?sslmode=bogus", "sslmode"),
        (f"postgresql://postgres:{SECRET}@127.0.0.1:abc/x", "port"),
        (f"postgresql://postgres:{SECRET}@nmbus-no-such-host.invalid:99999/x", "port"),
    ],
)
def test_a_malformed_dsn_is_one_line(dsn: str, needle: str) -> None:
    # A DSN that cannot be read is a bad option: exit 2, as docs/cli.md says.
    result = invoke("status", "--dsn", dsn)
    one_line_error(result.stderr, result.exit_code, 2, "DSN", needle)
    # Commands that open the library's store fail the same way.
    created = invoke("queues", "create", "billing", "--dsn", dsn)
    one_line_error(created.stderr, created.exit_code, 2)


def test_an_unreachable_database_is_one_line() -> None:
    result = invoke("status", "--dsn", DOWN)
    one_line_error(result.stderr, result.exit_code, 1, "cannot connect", "127.0.0.1:1")


def test_an_unreachable_primary_and_standby_are_one_line() -> None:
    # A DSN naming several servers is a DSN like any other: none answering is
    # "cannot connect" (exit 1), never an invalid DSN (urlsplit reads no port in it).
    both = "postgresql://postgres@127.0.0.1:1,127.0.0.1:2/x?target_session_attrs=read-write"
    result = invoke("status", "--dsn", both)
    one_line_error(result.stderr, result.exit_code, 1, "cannot connect", "127.0.0.1:1,127.0.0.1:2")
    created = invoke("queues", "create", "billing", "--dsn", both)
    one_line_error(created.stderr, created.exit_code, 1, "cannot connect")


@pytest.mark.parametrize("size", ["-5", "0", "100001"])
def test_cleanup_refuses_a_batch_size_out_of_range(dsn: str, size: str) -> None:
    # 0 used to mean "the default, 5000" without a word.
    result = invoke("cleanup", "--batch-size", size, "--dry-run", "--dsn", dsn)
    one_line_error(result.stderr, result.exit_code, 2, "--batch-size")


def test_cleanup_refuses_an_age_too_long_to_compute(dsn: str) -> None:
    for option in ("--older-than", "--failed-older-than"):
        result = invoke("cleanup", option, "99999999999w", "--dry-run", "--dsn", dsn)
        one_line_error(result.stderr, result.exit_code, 2, option, "99999999999w")


def test_an_invalid_setting_in_the_environment_is_one_line(dsn: str) -> None:
    result = invoke("status", "--dsn", dsn, env={"NMBUS_BATCH_SIZE": "abc"})
    one_line_error(result.stderr, result.exit_code, 2, "NMBUS_BATCH_SIZE", "abc")


def test_a_worker_without_its_database_is_one_line() -> None:
    proc = nmbus("worker", "tests.cli_app:bus", env={"NMBUS_DSN": DOWN})
    one_line_error(proc.stderr, proc.returncode, 1, "database unavailable")


def test_report_without_pyspark_is_one_line(tmp_path: Path) -> None:
    hidden = tmp_path / "nopyspark"
    hidden.mkdir()
    (hidden / "pyspark.py").write_text('raise ImportError("pyspark is hidden by this test")\n')
    proc = nmbus(
        "report", "--dsn", DOWN, "--out", str(tmp_path / "out"), env={"PYTHONPATH": str(hidden)}
    )
    one_line_error(proc.stderr, proc.returncode, 2, "pyspark", "nmbus[spark]")


@pytest.mark.parametrize("flag", ["--debug", "-v"])
def test_debug_shows_the_traceback_then_the_line(flag: str) -> None:
    result = invoke(flag, "status", "--dsn", DOWN)
    assert result.exit_code == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("error: cannot connect")


def test_debug_in_a_real_process() -> None:
    proc = nmbus("--debug", "worker", "tests.cli_app:bus", env={"NMBUS_DSN": DOWN})
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert "ConnectionRefusedError" in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("error: ")


# -- wrong usage exits 2, a failure 1 (docs/cli.md) ---------------------------------------------

BAD_ARGUMENTS = [
    (["worker", "module"], "expected module:attribute"),
    (["worker", "tests.no_such_module:bus"], "cannot import 'tests.no_such_module'"),
    (["worker", "tests.cli_app:nothing"], "has no attribute 'nothing'"),
    (["worker", "nmbus:__all__"], "expected a nmbus.Bus"),
    (["queues", "create", "Bad-Name!", "--dsn", DOWN], "invalid queue name 'Bad-Name!'"),
    (["queues", "drop", "Bad-Name!", "--yes", "--dsn", DOWN], "invalid queue name"),
    (["failed", "list", "bad name!", "--dsn", DOWN], "invalid queue name"),
    (["failed", "show", "Bad-Name!", "1", "--dsn", DOWN], "invalid queue name"),
    (["status"], "no database"),
    (["queues", "create", "billing"], "no database"),
    (["forward", "--once", "--dsn", DOWN], "no routes"),
    (["demo", "--flaky-rate", "1.5", "--no-report", "--dsn", DOWN], "--flaky-rate"),
    (["dashboard", "--host", "0.0.0.0", "--dsn", DOWN], "refusing to listen on 0.0.0.0"),
    (["dashboard", "--token", "short", "--dsn", DOWN], "the token is too short"),
]


@pytest.mark.parametrize(
    ("argv", "needle"), BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS]
)
def test_a_bad_argument_exits_2(argv: list[str], needle: str) -> None:
    # tests.cli_app builds its Bus when imported: from NMBUS_DSN, never connected to.
    result = invoke(*argv, env={"NMBUS_DSN": DOWN} if argv[0] == "worker" else None)
    one_line_error(result.stderr, result.exit_code, 2, needle)


def test_a_worker_whose_module_fails_to_import_exits_1(tmp_path: Path) -> None:
    # The target names a module that is there, but the application's own import
    # fails inside it: that is a failure, not wrong usage.
    (tmp_path / "broken_service.py").write_text("import nmbus_no_such_dependency\n")
    proc = nmbus("worker", "broken_service:bus", env={"PYTHONPATH": str(tmp_path)})
    one_line_error(proc.stderr, proc.returncode, 1, "nmbus_no_such_dependency")


# -- a command that reads never writes ----------------------------------------------------------

READ_COMMANDS = [
    ["status"],
    ["queues", "list"],
    ["failed", "list"],
    ["failed", "list", "billing"],
    ["failed", "show", "billing", "1"],
    ["subscriptions", "list"],
    ["cleanup", "--dry-run"],
]
# These write, but only to a schema that is there: none of them may create one.
WRITE_COMMANDS = [
    ["cleanup", "--yes"],
    ["failed", "requeue", "billing", "--all", "--yes"],
    ["failed", "purge", "billing", "--all", "--yes"],
    ["queues", "drop", "billing", "--yes"],
]


async def schemas(db: asyncpg.Connection) -> list[str]:
    rows = await db.fetch("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'nmbus%'")
    return sorted(r[0] for r in rows)


@pytest.mark.parametrize("argv", READ_COMMANDS + WRITE_COMMANDS, ids=" ".join)
async def test_a_missing_schema_is_reported_and_not_created(
    dsn: str, db: asyncpg.Connection, argv: list[str]
) -> None:
    assert await schemas(db) == ["nmbus"]
    for json_flag in ([], ["--json"]) if argv in READ_COMMANDS else ([],):
        result = await asyncio.to_thread(
            invoke, *argv, *json_flag, "--schema", "nmbus_dmeo", "--dsn", dsn
        )
        one_line_error(
            result.stderr, result.exit_code, 1, "no nmbus schema 'nmbus_dmeo' in this database"
        )
        assert result.stdout == ""
    assert await schemas(db) == ["nmbus"]  # nor its tables, nor its publish function


async def test_a_database_without_nmbus_says_there_are_no_queues(
    dsn: str, db: asyncpg.Connection
) -> None:
    await db.execute("DROP SCHEMA nmbus CASCADE")
    result = await asyncio.to_thread(invoke, "status", "--dsn", dsn)
    one_line_error(
        result.stderr, result.exit_code, 1, "no nmbus schema 'nmbus' in this database: no queues"
    )
    assert await schemas(db) == []
    # The one command that creates, still does.
    created = await asyncio.to_thread(invoke, "queues", "create", "billing", "--dsn", dsn)
    assert created.exit_code == 0, created.stderr
    assert await schemas(db) == ["nmbus"]
    listed = await asyncio.to_thread(invoke, "queues", "list", "--json", "--dsn", dsn)
    assert json.loads(listed.stdout) == ["billing"]
