"""The shop sample runs as its README says: four services, messages flow, retries happen."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

from nmbus import Bus
from tests.waits import wait_until

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
    # The fulfilment saga of every order heard of its payment and shipment, and completed.
    assert "[fulfilment] all 6 orders fulfilled" in result.stdout
    for order_id in range(1, 7):
        assert f"[fulfilment] order {order_id} fulfilled" in result.stdout
    assert await db.fetchval('SELECT count(*) FROM nmbus."fulfilment$saga"') == 0
    # The README's transcript is what a run prints: each of its lines (numbers aside)
    # is a line of this run, and every service that speaks here speaks there.
    transcript = _readme_transcript()
    printed = result.stdout.splitlines()
    unseen = [line for line in transcript if not any(_shape(line).fullmatch(p) for p in printed)]
    assert not unseen, "samples/README.md shows lines no run prints:\n" + "\n".join(unseen)
    speakers = {line.split("]", 1)[0] for line in printed if line.startswith("[")}
    assert speakers == {line.split("]", 1)[0] for line in transcript}, speakers
    handled = await db.fetch(
        "SELECT label, count(*) FROM nmbus.fulfilment WHERE subqueue = 'X' GROUP BY 1"
    )
    assert {r["label"]: r["count"] for r in handled if r["label"] != "shop.PaymentOverdue"} == {
        "shop.OrderPlaced": 6,
        "shop.PaymentTaken": 6,
        "shop.OrderShipped": 6,
    }
    # One payment-overdue timeout per order; those due after completion are ignored (X).
    assert (
        await db.fetchval(
            "SELECT count(*) FROM nmbus.fulfilment WHERE label = 'shop.PaymentOverdue'"
        )
        == 6
    )
    assert not await db.fetchval("SELECT count(*) FROM nmbus.fulfilment WHERE subqueue = 'F'")


async def test_a_payment_overdue_timeout_reminds_the_customer(
    dsn: str, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sample builds its Bus when imported, from NMBUS_DSN, as a service does.
    monkeypatch.setenv("NMBUS_DSN", dsn)
    from samples.shop.fulfilment import OrderPlaced

    # Fulfilment alone: an order is placed, its payment never comes.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-u", "-m", "samples.shop.fulfilment", "--payment-due", "0.5",
        cwd=ROOT, env={**os.environ, "NMBUS_DSN": dsn}, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(60):
            assert b"ready" in await proc.stdout.readline()
            async with Bus("orders", dsn=dsn, concurrency=0) as orders:
                await orders.publish(OrderPlaced(order_id=77, customer="ada"))
            lines = []
            while not lines or b"payment overdue" not in lines[-1]:
                lines.append(await proc.stdout.readline())
        assert b"order 77: payment overdue, reminding ada" in lines[-1]
        # Printed in the handler, committed just after.
        await wait_until(
            'SELECT state::text FROM nmbus."fulfilment$saga"',
            db=db,
            until=lambda state: '"reminded": true' in state,
            timeout=10,
        )
    finally:
        proc.terminate()
        await proc.wait()


README = ROOT / "samples" / "README.md"


def _readme_transcript() -> list[str]:
    """The lines of the shop's transcript in samples/README.md, without its "..." gaps."""
    text = README.read_text(encoding="utf-8")
    block = re.search(r"```text\n(\[billing\] ready\n.*?)```", text, re.DOTALL)
    assert block is not None, "samples/README.md has no transcript of the shop"
    return [line for line in block[1].splitlines() if line != "..."]


def _shape(line: str) -> re.Pattern[str]:
    """A line of the transcript with its numbers free (order ids, counts, delays)."""
    return re.compile(
        r"\d+(?:\.\d+)?".join(re.escape(part) for part in re.split(r"\d+(?:\.\d+)?", line))
    )


def test_every_service_of_the_shop_can_be_started_as_the_readme_says() -> None:
    text = README.read_text(encoding="utf-8")
    services = {p.stem for p in (ROOT / "samples" / "shop").glob("*.py")} - {"__init__", "all"}
    services = {name for name in services if not name.startswith("_")}
    started = set(re.findall(r"^python -m samples\.shop\.(\w+)", text, re.MULTILINE))
    assert services <= started, f"samples/README.md does not start {services - started}"
