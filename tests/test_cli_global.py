"""What `nmbus` does before any command: what it imports."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from typer.testing import CliRunner, Result

from nmbus.cli import app

ROOT = Path(__file__).resolve().parent.parent

runner = CliRunner()


@pytest.fixture(autouse=True)
def _keep_logging_config() -> Iterator[None]:
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def invoke(*argv: str) -> Result:
    return runner.invoke(app, list(argv), env={"COLUMNS": "200", "NMBUS_DSN": None})


def python(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


# -- importing the CLI imports the library, nothing more ------------------------------------------


def test_importing_the_cli_imports_no_demo_bench_soak_or_embedded_code() -> None:
    found = python(
        "import sys, nmbus, nmbus.cli; print(sorted(m for m in sys.modules if any(w in m for w "
        "in ('demo', 'bench', 'soak', 'embedded'))))"
    )
    assert found == "[]"


def test_a_worker_process_knows_no_demo_message_types() -> None:
    found = python(
        "import nmbus.cli, nmbus.messages as m; "
        "print(sorted(n for n in m._TYPES if n.startswith('demo.')))"
    )
    assert found == "[]"


def test_the_lazy_commands_are_listed_and_run() -> None:
    listed = invoke("--help")
    assert listed.exit_code == 0
    for name in ("bench", "demo", "soak", "status", "worker"):
        assert f" {name} " in listed.stdout, listed.stdout
    for name in ("bench", "demo", "soak"):
        helped = invoke(name, "--help")
        assert helped.exit_code == 0, helped.output
        assert f"nmbus {name}" in helped.stdout
