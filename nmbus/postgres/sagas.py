"""Saga states on PostgreSQL: the table ``"<endpoint>$saga"`` of each endpoint with sagas.

Its statements run on the handler's connection (``ctx.connection``), so the row
lock, the save and the message's move to X share the batch's transaction and
the handler's savepoint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import asyncpg
import structlog

from nmbus.names import validate_queue_name
from nmbus.postgres.errors import wrap_errors
from nmbus.postgres.sql import own_name, render
from nmbus.store import SagaRow

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
        self._lock = render("saga_lock", schema, endpoint)
        self._create = render("saga_lock_or_create", schema, endpoint)
        self._save = render("saga_save", schema, endpoint)
        self._delete = render("saga_delete", schema, endpoint)
        self._load = render("saga_load", schema, endpoint)
        self._endpoint = endpoint
        self._prefix = f"{schema}.{endpoint}$saga/"
        self._names: dict[str, int] = {}

    async def lock_keys(self, conn: Any, keys: Iterable[tuple[str, str]]) -> None:
        ids: set[tuple[int, int]] = set()
        for saga, key in keys:
            first = self._names.get(saga)
            if first is None:
                first = self._names[saga] = _lock_id(self._prefix + saga)
            ids.add((first, _lock_id(key)))
        if ids:
            # Sorted: every batch takes the locks it needs in the same order.
            ordered = sorted(ids)
            await conn.execute(self._lock_keys, [a for a, _ in ordered], [b for _, b in ordered])

    async def lock(
        self, conn: Any, saga: str, key: str, create: bool, instance: str
    ) -> SagaRow | None:
        # A plain lock first even for a start message: a saga usually exists, and
        # the upsert would write a row version that the save writes again.
        row = await conn.fetchrow(self._lock, saga, key)
        if row is None and create:
            row = await conn.fetchrow(self._create, saga, key, instance)
        return None if row is None else SagaRow(row[0], int(row[1]), row[2])

    async def save(self, conn: Any, saga: str, key: str, state: str, instance: str) -> None:
        await conn.execute(self._save, saga, key, state, instance)

    async def delete(self, conn: Any, saga: str, key: str) -> None:
        await conn.execute(self._delete, saga, key)

    async def load(self, saga: str, key: str) -> str | None:
        with wrap_errors(f"load saga {saga} of {self._endpoint}"):
            value: str | None = await self._pool().fetchval(self._load, saga, key)
        return value
