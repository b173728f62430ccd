"""Wake-ups of a worker's loops: one idle loop per hint, every loop to stop.

A NOTIFY says that something arrived in the queue, not how much. Waking every
idle loop for each one sends all of them to claim at once, where one finds the
message and the others find nothing: a wasted claim per message for every
extra loop, which the one that finds it waits behind on a busy server. So a
hint wakes one idle loop; a loop whose claim came back full (more may be
waiting) passes a hint on; and a hint that finds no loop idle is kept, so that
the next loop to go idle claims again at once instead of sleeping.
"""

from __future__ import annotations

import asyncio
from collections import deque
from contextlib import suppress


class Wakeups:
    """The idle loops of one worker, and a hint kept for the next one."""

    __slots__ = ("_idle", "_kept")

    def __init__(self) -> None:
        self._idle: deque[asyncio.Future[None]] = deque()
        self._kept = False

    def one(self) -> None:
        """Wake one idle loop; with none idle, the next loop to wait does not."""
        while self._idle:
            waiter = self._idle.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._kept = True

    def every(self) -> None:
        """Wake every idle loop, and the next to wait at once (the worker stops)."""
        while self._idle:
            waiter = self._idle.popleft()
            if not waiter.done():
                waiter.set_result(None)
        self._kept = True

    def claiming(self) -> None:
        """A loop is about to claim: a hint kept until now is served by that claim."""
        self._kept = False

    async def wait(self, timeout: float) -> bool:
        """Sleep until a hint or ``timeout`` seconds, whichever comes first: whether a hint."""
        if self._kept:
            self._kept = False
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter
            return True
        except TimeoutError:
            return False
        finally:
            # Woken, timed out (the timeout cancelled it) or cancelled: gone from the idle.
            waiter.cancel()
            with suppress(ValueError):
                self._idle.remove(waiter)

    @property
    def idle(self) -> int:
        """How many loops wait now."""
        return len(self._idle)
