"""Test helpers: an in-memory store that runs the real worker, and ``drain``.

``MemoryStore`` follows the same contracts as the PostgreSQL store (the suites
in ``tests/test_store_contract.py`` and ``tests/test_operations_contract.py``
run against both), so handlers, retries and shutdown can be unit-tested
without a database, and ``Admin.over(store)`` runs the operations layer on it.
It has no SQL connection: handlers that use ``ctx.connection`` need the real
store. The store itself is :mod:`nmbus.memory`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from nmbus.memory.store import MemoryBatch, MemorySession, MemoryStore
from nmbus.rows import QueueRow

if TYPE_CHECKING:
    from nmbus.bus import Bus

__all__ = ["MemoryBatch", "MemorySession", "MemoryStore", "Row", "drain"]

#: One row of an in-memory queue table, with the same columns as the real one.
Row = QueueRow


async def drain(bus: Bus, timeout: float = 10.0, queues: Sequence[str] | None = None) -> None:
    """Wait until ``queues`` (default: the bus's own) hold nothing ready or in flight.

    Scheduled rows whose time has not come do not count. Raises TimeoutError.
    """
    names = list(queues) if queues is not None else [bus.endpoint]
    async with asyncio.timeout(timeout):
        while True:
            busy = bus.worker.in_flight or any([await bus.store.has_ready(q) for q in names])
            if not busy:
                return
            await asyncio.sleep(0.02)
