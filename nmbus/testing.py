"""Test helpers: an in-memory store that runs the real worker, and ``drain``.

``MemoryStore`` follows the storage port's contract as the PostgreSQL store does
(``tests/test_store_contract.py`` runs against both), so sending, handling,
publish/subscribe, retries, sagas and shutdown can be tested without a
database. It has no SQL connection: handlers that use ``ctx.connection`` need
the real store, and operations (Admin, the dashboard) run on PostgreSQL only.
The store itself is :mod:`nmbus.memory`.
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
