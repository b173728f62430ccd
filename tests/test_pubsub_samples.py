"""The shop sample runs as its README says: three services, messages flow, retries happen."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import asyncpg

ROOT = Path(__file__).resolve().parent.parent


async def test_the_shop_sample_ships_every_order(dsn: str, db: asyncpg.Connection) -> None:
    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "samples.shop.all", "--orders", "6", "--interval", "0.05"],
        cwd=ROOT,
        env={**os.environ, "NMBUS_DSN": dsn},
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[orders] all 6 orders shipped" in result.stdout
    # Order 3 and 6 fail their first attempt on purpose, and are retried.
    assert "[billing] order 3: gateway timeout (attempt 1)" in result.stdout
    assert "(decoded as OrderEvent)" in result.stdout
    billing = await db.fetch("SELECT subqueue, retry_count FROM nmbus.billing")
    assert len(billing) == 6 and {r["subqueue"] for r in billing} == {"X"}
    assert max(r["retry_count"] for r in billing) >= 2
    for queue, count in (("shipping", 12), ("orders", 6)):
        done = await db.fetchval(f"SELECT count(*) FROM nmbus.{queue} WHERE subqueue = 'X'")
        assert done == count
