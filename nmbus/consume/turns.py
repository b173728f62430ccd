"""The turn the loops of one worker take under saga contention (Worker._serve).

Batches that need the same sagas run one after another anyway: a second batch
would only wait for them in memory, its claim and decoding taking the cores
from the batch every other one waits for. So while other processes' batches
hold what this endpoint's batches need, the loops of a process claim and run
one batch at a time: the loop that holds the turn. The holder keeps the turn
from batch to batch while the contention lasts (passed on after every batch,
it cost a sixth of the throughput: docs/performance.md, "Sagas on several
loops", the ninth and tenth sittings). A loop waits while the holder's batches
are short; once the batch that holds the turn has run TURN_SECONDS (its
handlers take long), it claims without it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

#: How long a batch under contention keeps its process's other loops waiting for the
#: turn (Turn.take), at most: a slow handler keeps no loop idle for longer.
TURN_SECONDS = 1.0


class Turn:
    """One worker's turn; ``contended`` tells whether the loops must take it."""

    def __init__(self, contended: Callable[[], bool]) -> None:
        self._contended = contended
        self._lock = asyncio.Lock()
        self._held = False  # from the acquire to the release (the lock says less)
        self._batch = 0.0  # when the holder's current batch began

    async def take(self) -> bool:
        """Wait for the turn under contention; returns whether this loop now holds it."""
        while self._contended():
            # Reckoned from the start of the holder's current batch; a turn just
            # given back (its next holder not yet woken) counts from now.
            held_for = time.monotonic() - self._batch if self._held else 0.0
            if held_for >= TURN_SECONDS:
                return False
            try:
                async with asyncio.timeout(TURN_SECONDS - held_for):
                    await self._lock.acquire()
            except TimeoutError:
                continue  # the holder may have begun another batch since: look again
            self._held = True
            self._batch = time.monotonic()
            return True
        return False

    def keep(self) -> bool:
        """The turn held for the last batch: kept for the next while contended."""
        if self._contended():
            self._batch = time.monotonic()
            return True
        self.give()
        return False

    def give(self) -> None:
        self._held = False
        self._lock.release()
