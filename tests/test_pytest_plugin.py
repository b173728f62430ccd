"""The pytest plugin an application's tests get with nmbus (entry point pytest11).

Each test runs pytest in a subprocess, in a folder of its own, on a test file
written as an application would write it: the fixtures come from the installed
entry point, not from this suite's conftest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import asyncpg

from tests.pg import with_database

DOCS = Path(__file__).resolve().parent.parent / "docs" / "testing.md"


def documented_example() -> str:
    """The code block of docs/testing.md's "A whole bus on a real database"."""
    section = DOCS.read_text().split("## A whole bus on a real database", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


# Beside the documented test: two tests that say which database each one got.
APP_TESTS = (
    documented_example()
    + """

from pathlib import Path


def test_first(nmbus_dsn):
    Path("dsn-1").write_text(nmbus_dsn)


async def test_second_gets_another_empty_database(nmbus_dsn):
    Path("dsn-2").write_text(nmbus_dsn)
    import asyncpg

    conn = await asyncpg.connect(nmbus_dsn)
    try:
        assert await conn.fetchval("SELECT to_regnamespace('nmbus')") is None
    finally:
        await conn.close()
"""
)


def run_app_tests(folder: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    (folder / "test_app.py").write_text(APP_TESTS)
    (folder / "pytest.ini").write_text(
        "[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"
    )
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "test_app.py"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def app_env(**changes: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NMBUS_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


async def databases_named(server: str, names: list[str]) -> list[str]:
    conn = await asyncpg.connect(server)
    try:
        rows = await conn.fetch("SELECT datname FROM pg_database WHERE datname = ANY($1)", names)
        return [r[0] for r in rows]
    finally:
        await conn.close()


async def test_nmbus_dsn_gives_each_test_a_fresh_database_of_the_given_server(
    tmp_path: Path,
) -> None:
    server = os.environ["NMBUS_TEST_DSN"]
    done = run_app_tests(tmp_path, app_env(NMBUS_TEST_DSN=server))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout
    dsns = [(tmp_path / f"dsn-{n}").read_text() for n in (1, 2)]
    names = [dsn.rsplit("/", 1)[1] for dsn in dsns]
    assert names[0] != names[1]
    assert all(dsn == with_database(server, name) for dsn, name in zip(dsns, names, strict=True))
    # Each was dropped after its test.
    assert await databases_named(server, names) == []


def test_nmbus_dsn_starts_an_embedded_postgresql_without_a_dsn(tmp_path: Path) -> None:
    done = run_app_tests(tmp_path, app_env(NMBUS_TEST_DSN=None))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout
    # Not the server NMBUS_TEST_DSN names: one of the plugin's own, on another port.
    dsn = (tmp_path / "dsn-1").read_text()
    assert dsn.startswith("postgresql://") and ":5432/" not in dsn


def test_without_any_postgresql_the_tests_are_skipped_with_how_to_get_one(
    tmp_path: Path,
) -> None:
    # No DSN, an embedded PostgreSQL whose binaries are missing, no Docker.
    shadow = tmp_path / "shadow"
    (shadow / "pgserver").mkdir(parents=True)
    (shadow / "pgserver" / "__init__.py").write_text("")  # a package without its binaries
    env = app_env(NMBUS_TEST_DSN=None, DOCKER_HOST="unix:///nonexistent/docker.sock")
    env["PYTHONPATH"] = os.pathsep.join([str(shadow), env["PYTHONPATH"]])
    done = run_app_tests(tmp_path, env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 skipped" in done.stdout
    assert "set NMBUS_TEST_DSN" in done.stdout
    assert "embedded PostgreSQL did not start" in done.stdout
    assert "testcontainers could not start one" in done.stdout
