"""A retention run over segments, killed at one of two points (SIGKILL by the test).

    python -m tests.segment_kill <dsn> <archive_dir> <max_age_seconds> before-drop|before-publish

``before-drop``: the segment's rows are in pending archive files and the
transaction that drops it holds the queue's lock, not yet committed.
``before-publish``: the drop committed, the pending files are not yet renamed.
Either way the run prints ``stuck`` and waits for ever.
"""

from __future__ import annotations

import asyncio
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg

from nmbus.operations import RetentionPolicy
from nmbus.postgres import reclaim
from nmbus.postgres.retention import clean_queue


def stuck(*_: Any, **__: Any) -> Any:
    print("stuck", flush=True)
    while True:
        time.sleep(60)


async def main(dsn: str, archive: str, max_age: float, point: str) -> None:
    conn = await asyncpg.connect(dsn)
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
