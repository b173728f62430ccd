from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import asyncpg
import pytest
import structlog

from nmbus import Bus
from tests.ops_data import Facts, populate
from tests.pg import Databases, missing_server, server_dsn

# Reports in tests start Spark without the driver's class archive, so no test
# leaves a builder running behind it; tests/test_stats_classcache.py turns it on.
os.environ.setdefault("NMBUS_SPARK_CLASS_CACHE", "off")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Markers that follow from where a test is, so the quick subset of the README
    (``-m "not reliability and not spark and not browser"``) holds for new tests too:
    every test in tests/reliability/ is ``reliability``, every test that drives
    Chromium (through the ``browser`` fixture) is ``browser``."""
    for item in items:
        if item.path.parent.name == "reliability":
            item.add_marker(pytest.mark.reliability)
        if "browser" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.browser)


def pytest_collection_finish(session: pytest.Session) -> None:
    """No PostgreSQL to be had, and a collected test needs one: stop now, on one line.

    Tests that need no database (``--collect-only`` too) run without one.
    """
    if session.config.option.collectonly:
        return
    needing = sum("databases" in getattr(item, "fixturenames", ()) for item in session.items)
    if not needing:
        return
    problem = missing_server()
    if problem is not None:
        pytest.exit(
            f"{problem}; {needing} of the tests collected need one",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


@pytest.fixture(autouse=True)
def _structlog_as_found() -> Iterator[None]:
    """A test that runs the CLI in-process configures structlog (its --log-level
    filter included) as a process would: the next test gets it back as it was."""
    saved = structlog.get_config()
    try:
        yield
    finally:
        structlog.configure(**saved)


@pytest.fixture(scope="session")
def databases() -> Iterator[Databases]:
    with server_dsn() as server:
        dbs = Databases(server)
        dbs.setup()
        try:
            yield dbs
        finally:
            dbs.teardown()


@pytest.fixture
def dsn(databases: Databases) -> Iterator[str]:
    """A DSN of a fresh database holding an empty nmbus schema, dropped afterwards."""
    with databases.fresh() as fresh:
        yield fresh


@pytest.fixture
async def db(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A plain connection to the test database, for looking at rows."""
    conn = await asyncpg.connect(dsn)
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def facts(db: asyncpg.Connection) -> Facts:
    """The test database populated by tests.ops_data: queues whose every figure is known."""
    return await populate(db)


@pytest.fixture
def make_bus(dsn: str) -> Callable[..., Bus]:
    """Build a Bus on the test database with test-friendly timings."""

    def make(endpoint: str, **overrides: Any) -> Bus:
        # One worker loop unless a test asks for more: these tests reason about the
        # order of one loop's batches. A worker's default of two loops runs in the
        # worker processes the crash, soak and saga tests start, and wherever a test
        # builds its Bus itself.
        settings: dict[str, Any] = {"poll_interval": 2.0, "lease_seconds": 10.0, "concurrency": 1}
        settings.update(overrides)
        return Bus(endpoint, dsn=dsn, **settings)

    return make


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With NMBUS_TEST_STRICT=1 (CI sets it) a skipped test fails the run.

    Tests skip only when a machine lacks Java, the JDBC driver, Chromium or
    PgBouncer; CI installs all four, so there a skip means something is broken.
    """
    if not os.environ.get("NMBUS_TEST_STRICT"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped:
        for report in skipped:
            print(f"\nNMBUS_TEST_STRICT: skipped {report.nodeid}: {report.longrepr}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
