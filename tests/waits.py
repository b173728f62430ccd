"""The one way a test waits for a state: poll it until it holds, or fail naming it.

A fixed sleep guesses how long a state takes to arrive; too short it fails on a
busy machine, too long it slows every run. ``wait_until`` asks for the state
itself, as often as ``interval``, and stops as soon as it holds.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import asyncpg


async def wait_until(
    check: Callable[[], Any] | str,
    *args: object,
    db: asyncpg.Connection | None = None,
    until: Callable[[Any], object] = bool,
    timeout: float = 30.0,
    interval: float = 0.05,
    what: str | None = None,
) -> Any:
    """Poll ``check`` until its value satisfies ``until`` (true, by default); return it.

    ``check`` is a function of no arguments (plain or ``async``), or a SQL query
    run on ``db`` with ``args`` whose first column of its first row is the
    value. ``until=lambda n: n >= 3`` waits for a count and, should the wait
    time out, reports the count last seen. An exception from ``check`` (a
    failed assertion, say) ends the wait at once. After ``timeout`` seconds it
    fails with an AssertionError naming what was awaited (``what``, else the
    query or the function) and the last value seen.
    """
    if isinstance(check, str):
        if db is None:
            raise TypeError("wait_until: a SQL query needs db=")
        query, conn = check, db

        async def probe() -> Any:
            return await conn.fetchval(query, *args)

        name = what or query
    else:
        if args:
            raise TypeError("wait_until: arguments go with a SQL query only")
        probe = check
        name = what or getattr(check, "__qualname__", repr(check))
    seen: Any = None
    deadline = asyncio.timeout(timeout)
    try:
        async with deadline:
            while True:
                value = probe()
                if inspect.isawaitable(value):
                    value = await value
                seen = value
                if until(seen):
                    return seen
                await asyncio.sleep(interval)
    except TimeoutError:
        if not deadline.expired():
            raise
    raise AssertionError(f"waited {timeout:g} s for {name}; the last value seen: {seen!r}")
