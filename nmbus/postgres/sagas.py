"""Saga states on PostgreSQL: the table ``"<endpoint>$saga"`` of each endpoint with sagas.

Its statements run on the batch's connection, in the batch's transaction: the
locks before the handlers run, the states written before the batch commits
with the messages' move to X (nmbus/sagas/saga.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import asyncpg
import structlog

from nmbus.names import validate_queue_name
from nmbus.ports.store import SagaKey, SagaRow, SagaSave
from nmbus.postgres.errors import wrap_errors
from nmbus.postgres.sql import own_name, render

log = structlog.get_logger("nmbus.postgres")


async def create_saga_table(pool: asyncpg.Pool, schema: str, endpoint: str) -> None:
    """Create the saga table of ``endpoint`` unless it exists, under the schema's lock."""
    validate_queue_name(endpoint)
    table = own_name(endpoint, "saga")
    with wrap_errors(f"create the saga table of {endpoint}"):
        async with pool.acquire() as conn:
            if await conn.fetchval(render("saga_table_exists", schema), schema, table):
                return
            async with conn.transaction():
                await conn.execute(render("advisory_lock", schema), f"nmbus.schema.{schema}")
                await conn.execute(render("create_saga_table", schema, endpoint))
    log.info("saga_table_created", queue=endpoint, schema=schema)


def _lock_id(text: str) -> int:
    """A 32-bit advisory lock key of ``text``, the same in every process."""
    digest = hashlib.blake2b(text.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big", signed=True)


class PostgresSagaTable:
    """The saga table of one endpoint."""

    def __init__(self, pool: Any, schema: str, endpoint: str) -> None:
        self._pool = pool
        self._lock_keys = render("saga_lock_keys", schema)
        self._try_lock_keys = render("saga_try_lock_keys", schema)
        self._lock_rows = render("saga_lock_rows", schema, endpoint)
        self._save_many = render("saga_save_many", schema, endpoint)
        self._delete_many = render("saga_delete_many", schema, endpoint)
        self._load = render("saga_load", schema, endpoint)
        self._endpoint = endpoint
        self._prefix = f"{schema}.{endpoint}$saga/"
        self._names: dict[str, int] = {}

    def _lock_ids(self, keys: Iterable[SagaKey]) -> dict[tuple[int, int], list[SagaKey]]:
        """The advisory lock of each saga (two sagas may share one: a hash)."""
        ids: dict[tuple[int, int], list[SagaKey]] = {}
        for saga, key in keys:
            first = self._names.get(saga)
            if first is None:
                first = self._names[saga] = _lock_id(self._prefix + saga)
            ids.setdefault((first, _lock_id(key)), []).append((saga, key))
        return ids

    async def lock_keys(self, conn: Any, keys: Iterable[SagaKey]) -> None:
        # Sorted: every transaction that waits takes the locks in the same order.
        ordered = sorted(self._lock_ids(keys))
        if ordered:
            await conn.execute(self._lock_keys, [a for a, _ in ordered], [b for _, b in ordered])

    async def try_lock_keys(self, conn: Any, keys: Iterable[SagaKey]) -> set[SagaKey]:
        ids = self._lock_ids(keys)
        if not ids:
            return set()
        pairs = list(ids)
        rows = await conn.fetch(self._try_lock_keys, [a for a, _ in pairs], [b for _, b in pairs])
        return {key for row in rows for key in ids[(row[0], row[1])]}

    async def lock_rows(self, conn: Any, keys: Iterable[SagaKey]) -> dict[SagaKey, SagaRow]:
        wanted = list(keys)
        if not wanted:
            return {}
        rows = await conn.fetch(
            self._lock_rows, [saga for saga, _ in wanted], [key for _, key in wanted]
        )
        return {(r[0], r[1]): SagaRow(r[2], int(r[3]), r[4]) for r in rows}

    async def write(self, conn: Any, saves: Sequence[SagaSave], deletes: Sequence[SagaKey]) -> None:
        if deletes:
            await conn.execute(
                self._delete_many, [saga for saga, _ in deletes], [key for _, key in deletes]
            )
        if saves:
            await conn.execute(
                self._save_many,
                [s.saga for s in saves],
                [s.key for s in saves],
                [s.state for s in saves],
                [s.instance for s in saves],
                [s.saves for s in saves],
            )

    async def load(self, saga: str, key: str) -> str | None:
        with wrap_errors(f"load saga {saga} of {self._endpoint}"):
            value: str | None = await self._pool().fetchval(self._load, saga, key)
        return value
