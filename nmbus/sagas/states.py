"""The saga states one batch holds: read before its handlers run, written before it commits.

A saga handler (nmbus/sagas/saga.py) reads and changes its saga's state here, in
memory: the batch's hook has locked and read every saga its messages name, in
two statements, and writes what changed in one more (two when sagas
completed) before each commit. A change is taken back when its message fails,
as the rollback of the message's savepoint takes back its writes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nmbus.ports.store import SagaKey, SagaRow, SagaSave, SagaTable


class _Held:
    """One saga a batch holds: its state now, and what its row in the table is."""

    __slots__ = ("instance", "renewed", "saves", "state", "stored")

    def __init__(self, row: SagaRow | None) -> None:
        #: The state's JSON now; None: no saga (never started, or completed).
        self.state = None if row is None else row.state
        self.instance = None if row is None else row.instance
        #: Whether the table holds a row for it (as of the batch's last write).
        self.stored = row is not None
        #: Saves since the last write, and whether it was completed and started
        #: again since then (its row is then replaced, not updated).
        self.saves = 0
        self.renewed = False

    def snapshot(self) -> tuple[str | None, str | None, int, bool]:
        return self.state, self.instance, self.saves, self.renewed

    def restore(self, values: tuple[str | None, str | None, int, bool]) -> None:
        self.state, self.instance, self.saves, self.renewed = values


class SagaStates:
    """The sagas one batch holds: locked before its handlers run, written before it commits.

    Saga handlers read and change the states here, in memory, without a
    statement of their own; a change is taken back when its message fails (as
    the message's savepoint would take back its writes), and what changed is
    written in one statement (two when sagas completed) before each commit.
    """

    __slots__ = ("_changed", "held", "table")

    def __init__(self, table: SagaTable) -> None:
        self.table = table
        self.held: dict[SagaKey, _Held] = {}
        self._changed: set[SagaKey] = set()

    async def take(self, conn: Any, keys: set[SagaKey], wait: bool) -> set[SagaKey]:
        """Lock the sagas ``keys`` (those free now, without ``wait``) and read them."""
        if wait:
            await self.table.lock_keys(conn, keys)
            taken = keys
        else:
            taken = await self.table.try_lock_keys(conn, keys)
        if taken:
            rows = await self.table.lock_rows(conn, taken)
            for key in taken:
                self.held[key] = _Held(rows.get(key))
        return taken

    def forget(self, key: SagaKey) -> None:
        """No longer hold saga ``key`` (its lock went with a rolled-back savepoint)."""
        self.held.pop(key, None)
        self._changed.discard(key)

    def change(self, key: SagaKey, state: str | None, instance: str) -> Callable[[], None]:
        """Set saga ``key``'s state (None: completed); returns what takes it back."""
        held = self.held[key]
        before = held.snapshot()
        was_changed = key in self._changed
        if state is None:
            held.state = None
            held.saves = 0  # a new life of the saga counts its own saves
        else:
            if held.state is None and held.stored:
                held.renewed = True  # completed in this batch, and started again
            held.state = state
            held.instance = instance
            held.saves += 1
        self._changed.add(key)

        def undo() -> None:
            held.restore(before)
            if not was_changed:
                self._changed.discard(key)

        return undo

    async def write(self, conn: Any) -> None:
        """Store what changed since the last write, in the batch's transaction."""
        if not self._changed:
            return
        saves: list[SagaSave] = []
        deletes: list[SagaKey] = []
        for key in sorted(self._changed):
            held = self.held[key]
            if held.stored and (held.state is None or held.renewed):
                deletes.append(key)
            if held.state is not None:
                assert held.instance is not None
                saves.append(SagaSave(key[0], key[1], held.state, held.instance, held.saves))
        await self.table.write(conn, saves, deletes)
        for key in self._changed:
            held = self.held[key]
            held.stored = held.state is not None
            held.saves = 0
            held.renewed = False
        self._changed.clear()
