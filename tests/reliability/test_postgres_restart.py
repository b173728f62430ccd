"""PostgreSQL restarts in the middle of a run, on a server of the test's own."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest
import structlog

from nmbus import Bus, Context, DatabaseUnavailable
from nmbus.testing import drain
from tests.messages import Ping
from tests.reliability.pgserver import PrivateServer
from tests.waits import wait_until

pytestmark = pytest.mark.reliability


async def _send_through(
    sender: Bus, start: int, stop_event: asyncio.Event, results: dict[str, str]
) -> None:
    """Send Pings until told to stop, recording each unique id as 'ok' or 'raised'."""
    n = start
    while not stop_event.is_set():
        uid = uuid.uuid4().hex
        try:
            await sender.send(Ping(n=n), to="billing", unique_id=uid)
            results[uid] = "ok"
        except DatabaseUnavailable:
            results[uid] = "raised"
            await asyncio.sleep(0.05)
        n += 1
        await asyncio.sleep(0.005)


def _logged(logs: list[dict[str, object]], event: str) -> bool:
    return any(e["event"] == event for e in logs)


@pytest.mark.parametrize("mode", ["fast", "immediate"])
async def test_workers_and_senders_live_through_a_postgres_restart(
    private_server: PrivateServer, private_dsn: str, mode: str
) -> None:
    setup = await asyncpg.connect(private_dsn)
    await setup.execute("CREATE TABLE effects (n int NOT NULL)")
    await setup.close()

    bus = Bus(
        "billing",
        dsn=private_dsn,
        concurrency=2,
        batch_size=20,
        lease_seconds=2.0,
        poll_interval=0.5,
        reconnect_max_delay=1.0,
    )

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        await ctx.connection.execute("INSERT INTO effects (n) VALUES ($1)", msg.n)
        await asyncio.sleep(0.003)

    sender = Bus("orders", dsn=private_dsn, concurrency=0)
    results: dict[str, str] = {}
    with structlog.testing.capture_logs() as logs:
        async with bus, sender:
            for n in range(1500):
                results[await sender.send(Ping(n=n), to="billing")] = "ok"
            await wait_until(
                lambda: bus.worker.handled, until=lambda n: n >= 200, timeout=60, interval=0.02
            )

            # 1. The server goes down: sends fail loudly while it is down.
            await asyncio.to_thread(private_server.stop, mode)
            try:
                for _ in range(3):
                    with pytest.raises(DatabaseUnavailable):
                        await sender.send(Ping(n=-1), to="billing")
                with pytest.raises(DatabaseUnavailable):
                    await sender.publish(Ping(n=-2))
                # The workers notice, and back off while it stays down.
                await wait_until(lambda: _logged(logs, "worker_connection_lost"))
            finally:
                await asyncio.to_thread(private_server.start)

            # 2. A real `pg_ctl restart` while a sender keeps sending.
            stop_sending = asyncio.Event()
            before = len(results)
            sending = asyncio.create_task(_send_through(sender, 10_000, stop_sending, results))
            await wait_until(lambda: len(results) - before >= 20, what="the sender under way")
            await asyncio.to_thread(private_server.restart, mode)
            after = len(results)
            await wait_until(
                lambda: list(results.values())[after:].count("ok") >= 20,
                what="sends going through again after the restart",
            )
            stop_sending.set()
            await sending

            # A send that raised may or may not have been stored; sending it again
            # with the same unique_id stores it exactly once.
            raised = [uid for uid, state in results.items() if state == "raised"]
            for uid in raised:
                async with asyncio.timeout(30):
                    while True:
                        try:
                            await sender.send(Ping(n=-3), to="billing", unique_id=uid)
                            break
                        except DatabaseUnavailable:
                            await asyncio.sleep(0.2)
            await drain(bus, timeout=90)

    events = [e["event"] for e in logs]
    assert "worker_connection_lost" in events, sorted(set(events))
    assert "worker_reconnected" in events, sorted(set(events))
    print(f"restart ({mode}): {len(raised)} sends raised, {len(results)} sent in all")

    conn = await asyncpg.connect(private_dsn)
    try:
        stored = {
            r["unique_id"]: r["subqueue"]
            for r in await conn.fetch("SELECT unique_id, subqueue FROM nmbus.billing")
        }
        effects = await conn.fetchval("SELECT count(*) FROM effects")
        distinct = await conn.fetchval("SELECT count(DISTINCT n) FROM effects")
    finally:
        await conn.close()
    missing = [uid for uid in results if uid not in stored]
    assert missing == []  # every send that returned, and every re-sent one, is there
    assert set(stored.values()) == {"X"}
    assert len(stored) == len(results)
    # Each Ping handled exactly once as far as committed effects go (n=-3 re-sends
    # of the same number aside).
    assert effects == len(stored)
    positives = len(stored) - sum(1 for s in results.values() if s == "raised")
    assert distinct >= positives
