"""Saga states in memory, for :mod:`nmbus.testing`'s HandlerTest and SagaScenario.

The saga table of the storage port (nmbus/ports/store.py) as a dict, for a
store that runs one batch at a time: there is no other batch to wait for, so
every lock is granted at once. What a batch writes waits for its commit, as in
PostgreSQL, on the batch's :class:`MemoryConnection`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any, NoReturn

from nmbus.errors import ConfigurationError
from nmbus.ports.store import SagaKey, SagaRow, SagaSave


class MemoryConnection:
    """A batch's connection in memory: no SQL; saga writes wait for the batch's commit."""

    __slots__ = ("pending", "why")

    def __init__(self, why: str) -> None:
        #: What the batch applies when it commits (dropped if it never does).
        self.pending: list[Callable[[], None]] = []
        self.why = why

    def commit(self) -> None:
        pending, self.pending = self.pending, []
        for apply in pending:
            apply()

    def _no_sql(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise ConfigurationError(self.why)

    async def execute(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._no_sql()

    executemany = fetch = fetchrow = fetchval = copy_records_to_table = execute


class MemorySagaTable:
    """One endpoint's saga rows, by (saga name, key), for one batch at a time."""

    def __init__(self) -> None:
        self.rows: dict[SagaKey, SagaRow] = {}

    async def lock_keys(self, conn: Any, keys: Iterable[SagaKey]) -> None:
        return None

    async def try_lock_keys(self, conn: Any, keys: Iterable[SagaKey]) -> set[SagaKey]:
        return set(keys)

    async def lock_rows(self, conn: Any, keys: Iterable[SagaKey]) -> dict[SagaKey, SagaRow]:
        return {key: replace(self.rows[key]) for key in keys if key in self.rows}

    async def write(self, conn: Any, saves: Sequence[SagaSave], deletes: Sequence[SagaKey]) -> None:
        saves, deletes = list(saves), list(deletes)

        def apply() -> None:
            for key in deletes:
                self.rows.pop(key, None)
            for save in saves:
                before = self.rows.get((save.saga, save.key))
                version = (before.version if before is not None else 0) + save.saves
                self.rows[(save.saga, save.key)] = SagaRow(save.state, version, save.instance)

        if isinstance(conn, MemoryConnection):
            conn.pending.append(apply)
        else:
            apply()

    async def load(self, saga: str, key: str) -> str | None:
        row = self.rows.get((saga, key))
        return None if row is None else row.state
