"""Where the tests get a real PostgreSQL, and a fresh database for each test.

``NMBUS_TEST_DSN`` when set; otherwise a testcontainers PostgreSQL when Docker
is reachable; otherwise the run stops before its first test with one line that
says how to provide one (``missing_server``, called by tests/conftest.py once the
tests are collected).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import uuid
import warnings
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from nmbus.postgres import install_schema

HOW_TO = (
    "nmbus's tests need a real PostgreSQL: export "
    "NMBUS_TEST_DSN=postgresql://postgres@127.0.0.1:5432/test (a server where the tests "
    "may create databases), or make a Docker engine reachable for testcontainers"
)


def missing_server() -> str | None:
    """Why no server can be had (one line, saying how to provide one), or None.

    Asked before the first test runs, so that a machine without any gets this one
    line instead of a Docker traceback for every test that needs a database.
    """
    if os.environ.get("NMBUS_TEST_DSN"):
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import docker
            import testcontainers.postgres  # noqa: F401
    except ImportError:
        return f"{HOW_TO} (testcontainers is not installed)"
    try:
        client = docker.from_env(timeout=5)
        try:
            client.ping()
        finally:
            client.close()
    except Exception:
        return f"{HOW_TO} (no Docker engine answers here)"
    return None


def with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


@contextmanager
def server_dsn() -> Iterator[str]:
    dsn = os.environ.get("NMBUS_TEST_DSN")
    if dsn:
        yield dsn
        return
    try:
        # testcontainers' own deprecation warnings are not ours to fail on.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from testcontainers.postgres import PostgresContainer

            container = PostgresContainer("postgres:16-alpine", driver=None)
            container.start()
    except Exception as exc:
        raise RuntimeError(f"{HOW_TO}\n(testcontainers could not start one: {exc})") from exc
    try:
        yield container.get_connection_url()
    finally:
        container.stop()


def _run(coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` to completion on a loop of its own, even inside a running loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, coro).result()


async def _admin(dsn: str, *statements: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


async def _install(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await install_schema(conn, "nmbus")
    finally:
        await conn.close()


class Databases:
    """Creates one migrated template per session and a copy of it per test."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.template = f"nmbus_tpl_{uuid.uuid4().hex[:10]}"

    def setup(self) -> None:
        _run(_admin(self.server, f'CREATE DATABASE "{self.template}"'))
        _run(_install(with_database(self.server, self.template)))

    def teardown(self) -> None:
        _run(_admin(self.server, f'DROP DATABASE IF EXISTS "{self.template}" WITH (FORCE)'))

    @contextmanager
    def fresh(self) -> Iterator[str]:
        name = f"nmbus_t_{uuid.uuid4().hex[:12]}"
        _run(_admin(self.server, f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"'))
        try:
            yield with_database(self.server, name)
        finally:
            _run(_admin(self.server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


async def index_parts(db: asyncpg.Connection, index: str) -> set[str]:
    """The names of the segments' parts of a partitioned index (``schema."name"``)."""
    rows = await db.fetch(
        "SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = $1::regclass",
        index,
    )
    return {r[0] for r in rows}
