"""What `nmbus` does before any command: global logging options, and what it imports."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import zipfile
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


def test_the_library_and_nmbus_worker_load_nothing_from_the_tools() -> None:
    found = python(
        "import sys, nmbus, nmbus.cli, nmbus.cli.worker; "
        "print(sorted(m for m in sys.modules if m.startswith(('nmbus.bench', 'nmbus.demo'))))"
    )
    assert found == "[]"


def test_only_the_tools_own_commands_import_the_tools() -> None:
    for tool in ("bench", "demo"):
        importers = {
            path.relative_to(ROOT).as_posix()
            for path in (ROOT / "nmbus").rglob("*.py")
            if path.parent.name != tool
            and re.search(rf"^\s*(from|import) nmbus\.{tool}\b", path.read_text(), re.MULTILINE)
        }
        # The pytest plugin starts the embedded PostgreSQL when no DSN is given.
        plugin = {"nmbus/pytest_plugin.py"} if tool == "demo" else set()
        allowed = {f"nmbus/cli/{tool}.py"} | plugin
        assert importers <= allowed


def test_nothing_in_nmbus_imports_the_repository_s_bench() -> None:
    # bench/ is not in the wheel: an import of it would fail where nmbus is installed.
    importers = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "nmbus").rglob("*.py")
        if re.search(r"^\s*(from|import) bench\b", path.read_text(), re.MULTILINE)
    }
    assert importers == set()


def test_the_wheel_ships_nmbus_with_no_script_file_and_no_repository_tools(
    tmp_path: Path,
) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("nmbus-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "nmbus/dashboard/templates/base.html" in names
    assert "nmbus/postgres/sql/schema.sql" in names
    assert [n for n in names if n.endswith(".js")] == []
    assert [n for n in names if n.split("/")[0] in ("bench", "tests", "samples")] == []


def test_a_worker_process_knows_no_demo_message_types() -> None:
    found = python(
        "import nmbus.cli, nmbus.messages as m; "
        "print(sorted(n for n in m._TYPES if n.startswith('demo.')))"
    )
    assert found == "[]"


def test_the_lazy_commands_are_listed_and_run() -> None:
    listed = invoke("--help")
    assert listed.exit_code == 0
    for name in ("bench", "demo", "status", "worker"):
        assert f" {name} " in listed.stdout, listed.stdout
    for name in ("bench", "demo"):
        helped = invoke(name, "--help")
        assert helped.exit_code == 0, helped.output
        assert f"nmbus {name}" in helped.stdout


# -- --log-level and --log-format ------------------------------------------------------------------


async def test_log_format_json_gives_json_lines(dsn: str) -> None:
    result = await asyncio.to_thread(
        invoke, "--log-level", "info", "--log-format", "json", "queues", "create", "alpha",
        "--dsn", dsn,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.stderr.splitlines()]  # each line is JSON
    assert ("queue_created", "info", "alpha") in [
        (e["event"], e["level"], e.get("queue")) for e in events
    ], events


async def test_the_default_level_hides_info_and_debug(dsn: str) -> None:
    result = await asyncio.to_thread(invoke, "queues", "create", "alpha", "--dsn", dsn)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert result.stdout == "ready: alpha\n"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [(["--log-level", "loud"], "--log-level"), (["--log-format", "xml"], "--log-format")],
)
def test_a_bad_log_option_is_a_usage_error(argv: list[str], needle: str) -> None:
    result = invoke(*argv, "version")
    assert result.exit_code == 2
    assert len(result.stderr.splitlines()) == 1 and needle in result.stderr, result.stderr
