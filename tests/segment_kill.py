"""A retention run over segments, killed at one of three points (SIGKILL by the test).

    python -m tests.segment_kill <dsn> <archive_dir> <max_age_seconds> <point>

``before-drop``: the segment's rows are in pending archive files and the
transaction that drops it holds the queue's lock, not yet committed.
``before-publish``: the drop committed, the pending files are not yet renamed.
``after-sequence-move``: a roll has moved the queue's identity sequence to the
next segment (which no rollback takes back) and not yet committed.
Each time the run prints ``stuck`` and waits for ever.
"""

from __future__ import annotations

import asyncio
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg

from nmbus.ports.operations import RetentionPolicy
from nmbus.postgres import reclaim
from nmbus.postgres.retention import clean_queue
from nmbus.postgres.segments import advance
from nmbus.postgres.sql import render


def stuck(*_: Any, **__: Any) -> Any:
    print("stuck", flush=True)
    while True:
        time.sleep(60)


class _StopsAfterTheMove:
    """The roll's connection; stuck once the sequence move has run, before the commit."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn
        self._move = render("segment_advance", "nmbus")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    async def fetchval(self, query: str, *args: Any) -> Any:
        found = await self._conn.fetchval(query, *args)
        if query == self._move:
            stuck()
        return found


async def main(dsn: str, archive: str, max_age: float, point: str) -> None:
    conn = await asyncpg.connect(dsn)
    if point == "after-sequence-move":
        await advance(_StopsAfterTheMove(conn), "nmbus", "billing")
        return
    if point == "before-publish":
        reclaim.publish = stuck  # type: ignore[assignment]
    else:
        pins = reclaim._pins
        calls = 0

        async def third_probe_stops(*args: Any, **kwargs: Any) -> bool:
            nonlocal calls
            calls += 1
            if calls == 3:  # the probe inside the drop's transaction
                stuck()
            return await pins(*args, **kwargs)

        reclaim._pins = third_probe_stops  # type: ignore[assignment]
    policy = RetentionPolicy(max_age=timedelta(seconds=max_age), archive_dir=Path(archive))
    await clean_queue(conn, "nmbus", "billing", policy)


if __name__ == "__main__":
    dsn, archive, max_age, point = sys.argv[1:]
    asyncio.run(main(dsn, archive, float(max_age), point))
