"""The suite on a machine with no PostgreSQL to be had: one line that says how to get one.

No NMBUS_TEST_DSN, no testcontainers (hidden by a module that fails to
import), no Docker engine (DOCKER_HOST names a socket that is not there) and no
embedded PostgreSQL (pgserver hidden the same way): a test file that needs a
database stops before its first test, on one line, instead of printing a
traceback for every test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pg import HOW_TO

ROOT = Path(__file__).resolve().parent.parent


def _pytest_without_a_server(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    hidden = tmp_path / "hidden"
    for name in ("testcontainers", "pgserver"):
        (hidden / name).mkdir(parents=True)
        (hidden / name / "__init__.py").write_text(f'raise ImportError("{name} is hidden")\n')
    env = {k: v for k, v in os.environ.items() if k not in ("NMBUS_TEST_DSN", "NMBUS_DSN")}
    env["PYTHONPATH"] = os.pathsep.join([str(hidden), str(ROOT)])
    env["DOCKER_HOST"] = f"unix://{tmp_path / 'no-docker.sock'}"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_without_a_server_the_run_stops_at_once_on_one_line(tmp_path: Path) -> None:
    run = _pytest_without_a_server(tmp_path, "tests/test_cli.py")
    output = run.stdout + run.stderr
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, output
    said = [line for line in output.splitlines() if HOW_TO in line]
    assert len(said) == 1, output
    assert "export NMBUS_TEST_DSN=postgresql://" in said[0]
    assert "tests collected need one" in said[0]
    # Nothing ran: no test, no traceback, only pytest's header and this line.
    assert "Traceback" not in output and "passed" not in output and "failed" not in output
    assert len(output.splitlines()) < 20, output


def test_tests_that_need_no_server_still_run_without_one(tmp_path: Path) -> None:
    run = _pytest_without_a_server(tmp_path, "-q", "tests/test_cli_help.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert HOW_TO not in run.stdout + run.stderr
    assert " passed" in run.stdout
