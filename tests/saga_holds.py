"""A saga held by another transaction, as a batch of another worker process would
hold it (tests/test_saga_batches.py, tests/test_saga_turns.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
from asyncpg.transaction import Transaction

from nmbus.postgres.sagas import PostgresSagaTable

#: How many advisory locks other sessions wait for (a batch waiting for a saga).
WAITING_FOR_A_LOCK = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
    " AND pid <> pg_backend_pid()"
)


@asynccontextmanager
async def held_elsewhere(dsn: str, saga: str, key: str) -> AsyncIterator[Transaction]:
    """Another transaction holds saga ``key`` of type ``saga`` on endpoint "counting",
    as a batch of another worker would; committing it (or the end) lets go."""
    holder = await asyncpg.connect(dsn)
    try:
        held = holder.transaction()
        await held.start()
        await PostgresSagaTable(None, "nmbus", "counting").lock_keys(holder, [(saga, key)])
        yield held
    finally:
        await holder.close()
