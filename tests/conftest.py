from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.pg import Databases, server_dsn


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
