"""nmbus's pytest plugin: a real PostgreSQL for an application's own tests.

Installed with nmbus (entry point ``pytest11``, named ``nmbus``), so any test
suite of a project that depends on nmbus has these fixtures:

``nmbus_dsn``
    The DSN of a fresh, empty database for one test, dropped after it. The
    server is found once per test session: ``NMBUS_TEST_DSN`` (a DSN whose
    user may create databases) when set; else an embedded PostgreSQL (the
    ``embedded`` extra, in a temporary folder, stopped at the end); else a
    testcontainers PostgreSQL when Docker is reachable. With none of them the
    test is skipped, and the reason says how to provide one.

``nmbus_drain``
    ``await nmbus_drain(bus)``: wait until the bus's queue (or ``queues=``)
    holds nothing ready or in flight; ``nmbus.testing.drain``.

The plugin imports nothing heavy until a test asks for a fixture, so a suite
that uses none of them pays nothing for it. docs/testing.md shows it in use.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import uuid
import warnings
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

HOW_TO = (
    "no PostgreSQL for nmbus_dsn: set NMBUS_TEST_DSN (e.g. "
    "postgresql://postgres@127.0.0.1:5432/postgres), or pip install 'nmbus[embedded]', "
    "or make a Docker engine reachable for testcontainers"
)


def _with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


def _embedded(stack: ExitStack, folder: Path) -> tuple[str | None, str]:
    """An embedded PostgreSQL's DSN, or None and why there is none."""
    from nmbus.demo.embedded import EmbeddedPostgres, EmbeddedUnavailable

    server = EmbeddedPostgres(folder)
    try:
        dsn = server.start()
    except EmbeddedUnavailable:
        return None, "the embedded extra is not installed"
    except Exception as exc:
        return None, f"the embedded PostgreSQL did not start ({str(exc).splitlines()[0]})"
    stack.callback(server.destroy)
    return dsn, ""


def _container(stack: ExitStack) -> tuple[str | None, str]:
    """A testcontainers PostgreSQL's DSN, or None and why there is none."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from testcontainers.postgres import PostgresContainer

            container = PostgresContainer("postgres:16-alpine", driver=None)
            container.start()
    except ImportError:
        return None, "testcontainers is not installed"
    except Exception as exc:
        return None, f"testcontainers could not start one ({str(exc).splitlines()[0][:120]})"
    stack.callback(container.stop)
    return container.get_connection_url(), ""


@pytest.fixture(scope="session")
def nmbus_server_dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The DSN of the PostgreSQL server ``nmbus_dsn`` makes its databases on."""
    given = os.environ.get("NMBUS_TEST_DSN")
    if given:
        yield given
        return
    with ExitStack() as stack:
        dsn, embedded_why = _embedded(stack, tmp_path_factory.mktemp("nmbus-pg") / "data")
        if dsn is None:
            dsn, docker_why = _container(stack)
            if dsn is None:
                pytest.skip(f"{HOW_TO} ({embedded_why}; {docker_why})")
        yield dsn


def _admin(dsn: str, statement: str) -> None:
    import asyncpg

    async def run() -> None:
        conn = await asyncpg.connect(dsn, timeout=30)
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    # A loop of its own, in a thread: the fixture may be set up while a loop runs.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, run()).result()


@pytest.fixture
def nmbus_dsn(nmbus_server_dsn: str) -> Iterator[str]:
    """A fresh, empty database for this test (nmbus creates its schema on first use)."""
    name = f"nmbus_test_{uuid.uuid4().hex[:12]}"
    _admin(nmbus_server_dsn, f'CREATE DATABASE "{name}"')
    try:
        yield _with_database(nmbus_server_dsn, name)
    finally:
        _admin(nmbus_server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def nmbus_drain() -> Callable[..., Awaitable[None]]:
    """``await nmbus_drain(bus, timeout=10.0, queues=None)``: wait until the queues are idle."""
    from nmbus.testing import drain

    async def run(bus: Any, timeout: float = 10.0, queues: Any = None) -> None:
        await drain(bus, timeout=timeout, queues=queues)

    return run
