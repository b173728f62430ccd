"""A retention run that stops inside its first archive write, to be killed there.

    python -m tests.retention_kill <dsn> <archive_dir> <max_age_seconds> <batch> empty|torn

Runs ``clean_queue`` on queue ``billing`` with the archive; the first Parquet
write writes nothing (``empty``) or the first half of the file (``torn``),
syncs that to disk, prints ``stuck <path>`` and waits for ever: the test
SIGKILLs it there.
"""

from __future__ import annotations

import asyncio
import io
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pyarrow.parquet as pq

from nmbus.ports.operations import RetentionPolicy
from nmbus.postgres.retention import clean_queue


def stuck_writer(mode: str) -> Any:
    original = pq.write_table

    def write_table(table: Any, where: Any, **kwargs: Any) -> None:
        if mode == "torn":
            whole = io.BytesIO()
            original(table, whole, **kwargs)
            data = whole.getvalue()
            where.write(data[: len(data) // 2])
        where.flush()
        os.fsync(where.fileno())
        print(f"stuck {where.name}", flush=True)
        while True:
            time.sleep(60)

    return write_table


async def main(dsn: str, archive: str, max_age: float, batch: int, mode: str) -> None:
    conn = await asyncpg.connect(dsn)
    policy = RetentionPolicy(
        max_age=timedelta(seconds=max_age), batch_size=batch, archive_dir=Path(archive)
    )
    pq.write_table = stuck_writer(mode)  # the run's first write never returns
    await clean_queue(conn, "nmbus", "billing", policy)


if __name__ == "__main__":
    dsn, archive, max_age, batch, mode = sys.argv[1:]
    asyncio.run(main(dsn, archive, float(max_age), int(batch), mode))
