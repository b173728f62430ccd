from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.pg import Databases
from tests.reliability.pgserver import PrivateServer
from tests.reliability.pgserver import private_server as started_server


@pytest.fixture(scope="session")
def private_server() -> Iterator[PrivateServer]:
    """A PostgreSQL cluster of this test session's own, which tests may restart."""
    with started_server() as server:
        yield server


@pytest.fixture(scope="session")
def private_databases(private_server: PrivateServer) -> Iterator[Databases]:
    dbs = Databases(private_server.dsn)
    dbs.setup()
    try:
        yield dbs
    finally:
        if private_server.running():
            dbs.teardown()


@pytest.fixture
def private_dsn(private_databases: Databases) -> Iterator[str]:
    """A fresh database on the private server (which the test may restart)."""
    with private_databases.fresh() as fresh:
        yield fresh
