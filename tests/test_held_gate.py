"""A held batch whose backend ends before it begins: at the process gate.

A loop that claims a batch while a crash's suspect runs alone in its process
waits at the process gate, its rows held by its open transaction. Should its
backend end there (an operator's pg_terminate_backend, a failover), its locks
and its holder lock go, and any worker recovers the batch: the loop must not
run it once the gate opens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import asyncpg
import pytest

from nmbus import Bus, Context, Message
from tests.waits import wait_until

HELD = 'nmbus."billing$held"'


class Suspect(Message, type_name="tests.gate.Suspect"):
    n: int


class Work(Message, type_name="tests.gate.Work"):
    n: int


async def test_a_held_batch_whose_backend_ended_at_the_gate_is_not_run_there(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    suspect_running, suspect_may_end = asyncio.Event(), asyncio.Event()
    runs: list[int] = []  # the attempts Work ran as
    bus = make_bus("billing", held_batches=True, concurrency=2, batch_size=1, poll_interval=0.1)
    conns: list[asyncpg.Connection] = []  # the bus's worker connections
    connect = bus.store.connect  # type: ignore[attr-defined]

    async def recorded() -> asyncpg.Connection:
        conn: asyncpg.Connection = await connect()
        conns.append(conn)
        return conn

    monkeypatch.setattr(bus.store, "connect", recorded)

    @bus.handler
    async def suspect(msg: Suspect, ctx: Context) -> None:
        suspect_running.set()
        await suspect_may_end.wait()

    @bus.handler
    async def work(msg: Work, ctx: Context) -> None:
        runs.append(ctx.retry_count)  # an outside effect: no ctx.connection

    async with make_bus("orders", concurrency=0) as sender:
        await sender.send(Suspect(n=0), to="billing")
    # What a crash leaves: the lease of a worker that died ran out, one attempt counted.
    await db.execute(
        "UPDATE nmbus.billing SET handling_client_id = 'dead', lease_expires = 'epoch', "
        "retry_count = 1"
    )
    async with bus:
        await asyncio.wait_for(suspect_running.wait(), 10)
        async with make_bus("orders", concurrency=0) as sender:
            await sender.send(Work(n=1), to="billing")
        # The other loop claims Work, held, and waits at the gate for the suspect.
        await wait_until(f"SELECT count(*) FROM {HELD}", db=db, until=lambda n: n == 1)
        # The held batch's backend: the one holding the holder lock its record names.
        holders = await db.fetch(
            f"SELECT l.pid FROM pg_locks AS l JOIN {HELD} AS h "
            "ON ((l.classid::bigint << 32) | l.objid::bigint) = h.holder "
            "WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted"
        )
        assert len(holders) == 1
        pid = holders[0]["pid"]
        await db.execute("SELECT pg_terminate_backend($1)", pid)
        # pg_terminate_backend only signals the backend: the gate opens once the loop
        # has seen its connection end. Opened before, the batch begins on a connection
        # still alive as far as the loop knows, and its backend ends under it (the
        # handler stopped if it still runs; this one, instant, would have run).
        await wait_until(
            lambda: any(c.is_closed() for c in conns if c.get_server_pid() == pid),
            what="the held batch's loop sees its connection end",
        )
        suspect_may_end.set()
        # Recovered as a crash's batch (its ended attempt counted) and run once.
        await wait_until(
            "SELECT subqueue FROM nmbus.billing WHERE label = 'tests.gate.Work'",
            db=db,
            until=lambda s: s == "X",
        )
    assert runs == [2]
    assert await db.fetchval(f"SELECT count(*) FROM {HELD}") == 0
