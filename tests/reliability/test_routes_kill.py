"""SIGKILL the forwarder (docs/routes.md): 0 lost, 0 duplicated in the remote queue."""

from __future__ import annotations

import asyncio
import random

import asyncpg

from nmbus import Bus, Message
from nmbus.postgres.forwarder import Forwarder
from tests.pg import Databases
from tests.procs import Proc

MESSAGES = 5000
PER_TRANSACTION = 50


class Billed(Message, type_name="test.routes.Billed"):
    n: int


def forwarder_proc(dsn: str, remote: str, *extra: str) -> Proc:
    return Proc("tests.routes_forwarder", dsn, f"billing={remote}", *extra)


async def forward_everything(dsn: str, remote: str) -> Forwarder:
    forwarder = Forwarder(dsn, {"billing": remote}, batch_size=500)
    try:
        await forwarder.forward_all()
    finally:
        await forwarder.close()
    return forwarder


async def test_a_forwarder_killed_after_the_remote_commit_duplicates_nothing(
    dsn: str, databases: Databases
) -> None:
    with databases.fresh() as remote:
        bus = Bus("orders", dsn=dsn, routes={"billing": remote}, concurrency=0)
        async with bus:
            sent = [await bus.send(Billed(n=i), to="billing") for i in range(20)]
        proc = forwarder_proc(dsn, remote, "--batch", "5", "--die-after-commit")
        try:
            await proc.wait_for("committed 5")
        finally:
            proc.kill()
        assert proc.popen.returncode == -9
        local, far = await asyncpg.connect(dsn), await asyncpg.connect(remote)
        try:
            # The remote committed five rows; the outbox still holds all twenty.
            assert await far.fetchval("SELECT count(*) FROM nmbus.billing") == 5
            assert await local.fetchval("SELECT count(*) FROM nmbus.outbox") == 20
            forwarder = await forward_everything(dsn, remote)
            assert (forwarder.stats.taken, forwarder.stats.inserted) == (20, 15)
            ids = [r[0] for r in await far.fetch("SELECT unique_id FROM nmbus.billing ORDER BY id")]
            assert ids == sent
            assert await local.fetchval("SELECT count(*) FROM nmbus.outbox") == 0
        finally:
            await local.close()
            await far.close()


async def test_sigkill_of_the_forwarder_in_a_loop_loses_and_duplicates_nothing(
    dsn: str, databases: Databases
) -> None:
    with databases.fresh() as remote:
        bus = Bus("orders", dsn=dsn, routes={"billing": remote}, concurrency=0)
        sent: list[str] = []

        async def send_all() -> None:
            conn = await asyncpg.connect(dsn)
            try:
                for start in range(0, MESSAGES, PER_TRANSACTION):
                    async with conn.transaction():
                        for i in range(start, start + PER_TRANSACTION):
                            uid = await bus.send(Billed(n=i), to="billing", connection=conn)
                            sent.append(uid)
                    await asyncio.sleep(0.01)
            finally:
                await conn.close()

        kills = 0
        rng = random.Random(16)
        async with bus:
            sender = asyncio.create_task(send_all())
            while not sender.done() or kills < 10:
                proc = forwarder_proc(dsn, remote)
                try:
                    await proc.wait_for("ready")
                    await asyncio.sleep(rng.uniform(0.1, 0.7))
                finally:
                    proc.kill()
                kills += 1
            await sender
        far = await asyncpg.connect(remote)
        try:
            before = await far.fetchval("SELECT count(*) FROM nmbus.billing")
            # The killed forwarders moved part of the backlog; one more moves the rest.
            assert before > 0
            await forward_everything(dsn, remote)
            rows = await far.fetch("SELECT unique_id FROM nmbus.billing")
        finally:
            await far.close()
        stored = [r[0] for r in rows]
        assert len(sent) == MESSAGES
        assert len(stored) == MESSAGES  # nothing duplicated...
        assert set(stored) == set(sent)  # ...and nothing lost
        local = await asyncpg.connect(dsn)
        try:
            assert await local.fetchval("SELECT count(*) FROM nmbus.outbox") == 0
        finally:
            await local.close()
