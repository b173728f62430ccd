"""Held batches (setting held_batches): each row written once, and what a crash leaves.

The guarantees' own tests (test_guarantees.py, tests/reliability/) run in both
claim modes (the ``claims`` fixture of tests/conftest.py); these look at what
only a held batch does: its rows are locked, not leased, while it runs; a
record on a second connection stands for them; a part commit or a rollback
leases the rest; a record whose holder died is recovered, once, as a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import asyncpg
import pytest

from nmbus import Bus, Context
from nmbus.testing import drain
from tests import procs
from tests.messages import Ping, Slow
from tests.saga_holds import held_elsewhere
from tests.saga_workers import Counter, Increment
from tests.waits import wait_until

HELD = 'nmbus."billing$held"'


class Worker(procs.Proc):
    """tests/workers.py's worker, its batches held, on one loop: messages sent before
    it starts are one batch (two loops' first claims, at once, may split them)."""

    def __init__(self, dsn: str, queue: str, lease: str = "1.0") -> None:
        env = {"NMBUS_HELD_BATCHES": "true", "NMBUS_CONCURRENCY": "1"}
        super().__init__("tests.workers", "worker", dsn, queue, lease, env=env)


@contextlib.asynccontextmanager
async def holding_a_slow_message(dsn: str, make_bus: Callable[..., Bus]) -> AsyncIterator[Worker]:
    """A held worker process inside the handler of a Slow sent to billing (it never
    returns, unless cancelled: it says "stopped 1"); killed on the way out."""
    worker = Worker(dsn, "billing", "10.0")
    try:
        await worker.wait_for("ready")
        async with make_bus("orders", concurrency=0) as sender:
            await sender.send(Slow(n=1), to="billing")
        await worker.wait_for("started 1")
        yield worker
    finally:
        worker.kill()


def rival_of(make_bus: Callable[..., Bus], runs: list[str]) -> Bus:
    """A leased worker on billing claiming every 0.1 s; a Slow it runs adds "rival"."""
    rival = make_bus("billing", lease_seconds=1.0, poll_interval=0.1)

    @rival.handler
    async def steal(msg: Slow, ctx: Context) -> None:
        runs.append("rival")

    return rival


async def count_updates(db: asyncpg.Connection, queue: str = "billing") -> None:
    """Count every row version the queue's rows get from now on (table updates)."""
    await db.execute(
        """
        CREATE TABLE updates (n bigint NOT NULL DEFAULT 0);
        INSERT INTO updates VALUES (0);
        CREATE FUNCTION count_update() RETURNS trigger LANGUAGE plpgsql AS $f$
        BEGIN UPDATE updates SET n = n + 1; RETURN NULL; END $f$;
        """
    )
    await db.execute(
        f'CREATE TRIGGER counted AFTER UPDATE ON nmbus."{queue}" '
        "FOR EACH ROW EXECUTE FUNCTION count_update()"
    )


@pytest.mark.parametrize("held", [True, False], ids=["held", "leased"])
async def test_a_held_batch_writes_each_row_once_and_leaves_no_record(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, held: bool
) -> None:
    async with make_bus("billing", concurrency=0) as sender:
        await count_updates(db)
        for n in range(300):
            await sender.send(Ping(n=n), to="billing")
    bus = make_bus("billing", held_batches=held, batch_size=100)
    seen: list[tuple[int, int, str | None, bool]] = []

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        if msg.n % 100 == 0:
            # What another connection sees of the row being handled, and of the record.
            row = await db.fetchrow(
                'SELECT retry_count, handling_client_id FROM nmbus."billing" WHERE id = $1',
                ctx.message_id,
            )
            recorded = await db.fetchval(
                f"SELECT count(*) FROM {HELD} WHERE $1 = ANY(ids)", ctx.message_id
            )
            seen.append(
                (ctx.retry_count, row["retry_count"], row["handling_client_id"], bool(recorded))
            )

    async with bus:
        await drain(bus)
    counts = await db.fetch(
        'SELECT subqueue, retry_count, count(*) FROM nmbus."billing" GROUP BY 1, 2'
    )
    assert [tuple(r) for r in counts] == [("X", 1, 300)]
    assert await db.fetchval(f"SELECT count(*) FROM {HELD}") == 0
    assert len(seen) == 3
    if held:
        # Locked, not leased: the row is as sent until its finish, the record names it.
        assert seen == [(1, 0, None, True)] * 3
        assert await db.fetchval("SELECT n FROM updates") == 300
    else:
        assert all(s[:2] == (1, 1) and s[2] is not None and not s[3] for s in seen)
        assert await db.fetchval("SELECT n FROM updates") == 600


async def test_a_held_batch_that_commits_a_part_leases_the_rest(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    async with make_bus("billing", concurrency=0) as sender:
        for n in range(6):
            await sender.send(Ping(n=n), to="billing")
    bus = make_bus("billing", held_batches=True, batch_commit_interval=0.05)
    states: dict[int, tuple[str, str | None, int]] = {}

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        row = await db.fetchrow(
            'SELECT subqueue, handling_client_id, retry_count FROM nmbus."billing" WHERE id = $1',
            ctx.message_id,
        )
        states[msg.n] = (row["subqueue"], row["handling_client_id"], row["retry_count"])
        await asyncio.sleep(0.08)  # longer than the commit interval: a part commits after each

    async with bus:
        await drain(bus)
    # The first ran held (the row untouched); the part commit after it leased the
    # rest to this worker, their attempt counted then, as a claim would have.
    assert states[0] == ("I", None, 0)
    for n in range(1, 6):
        assert states[n][0] == "I" and states[n][1] is not None and states[n][2] == 1, states
    counts = await db.fetch(
        'SELECT subqueue, retry_count, count(*) FROM nmbus."billing" GROUP BY 1, 2'
    )
    assert [tuple(r) for r in counts] == [("X", 1, 6)]
    assert await db.fetchval(f"SELECT count(*) FROM {HELD}") == 0


async def test_a_held_batch_killed_mid_handler_is_recovered_once_as_a_crash(
    dsn: str, make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    async with make_bus("orders", concurrency=0) as sender:
        # Both sent before the worker starts: one batch holds them.
        await sender.send(Slow(n=7), to="billing")
        await sender.send(Ping(n=8), to="billing")
    doomed = Worker(dsn, "billing")
    try:
        await doomed.wait_for("ready")
        await doomed.wait_for("started 7")
        (row_id, ping_id) = [
            r[0] for r in await db.fetch('SELECT id FROM nmbus."billing" ORDER BY id')
        ]
        # While it lives: nothing written to the rows, the record names them.
        assert await db.fetchval(f"SELECT ids FROM {HELD}") == [row_id, ping_id]
        doomed.kill()
    finally:
        doomed.kill()
    await db.execute("CREATE TABLE effects (n int, pid int)")
    # Killed: the record stays, and the rows are as sent (no attempt written yet).
    rows = await db.fetch(
        'SELECT subqueue, retry_count, handling_client_id FROM nmbus."billing" ORDER BY id'
    )
    assert [tuple(r) for r in rows] == [("I", 0, None), ("I", 0, None)]
    assert await db.fetchval(f"SELECT count(*) FROM {HELD}") == 1

    # A leased worker's claim leaves them alone until the record is recovered.
    bus = make_bus("billing", poll_interval=0.3, lease_seconds=1.0)
    handled: list[tuple[int, int, int]] = []

    @bus.handler
    async def on_slow(msg: Slow, ctx: Context) -> None:
        handled.append((msg.n, ctx.retry_count, ctx.message_id))

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        handled.append((msg.n, ctx.retry_count, ctx.message_id))

    async with bus:
        await wait_until(lambda: len(handled) == 2, timeout=15)
        await drain(bus)
    # The dead attempt counted once for each (both were in the dead batch, as with
    # a lease); then, as after a lease ran out, one suspect runs alone (its second
    # attempt) and the other is given its attempts back (nothing says it was the
    # one that killed the worker): its first.
    assert sorted(handled) == [(7, 2, row_id), (8, 1, ping_id)]
    rows = await db.fetch('SELECT subqueue, retry_count FROM nmbus."billing" ORDER BY id')
    assert [tuple(r) for r in rows] == [("X", 2), ("X", 1)]
    assert await db.fetchval(f"SELECT count(*) FROM {HELD}") == 0


async def test_a_live_holder_is_never_taken_for_dead(
    dsn: str, make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    async with holding_a_slow_message(dsn, make_bus):
        recover = 'SELECT count(*) FROM nmbus."billing$held"'
        # Other workers recover (on empty claims and every poll): the record stays.
        bus = make_bus("billing", poll_interval=0.1)
        async with bus:
            await asyncio.sleep(1.0)
            assert await db.fetchval(recover) == 1
        (row,) = await db.fetch(
            'SELECT subqueue, retry_count, handling_client_id FROM nmbus."billing"'
        )
        assert tuple(row) == ("I", 0, None)


async def test_a_record_naming_a_row_another_record_names_is_refused(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    from nmbus.postgres.sql import render

    async with make_bus("billing", concurrency=0):
        pass
    record = render("held_record", "nmbus", "billing")
    assert await db.fetchval(record, 1, 2**40, "a", [10, 11]) == 1
    assert await db.fetchval(record, 2, 2**40 + 1, "b", [12, 11]) == 0
    assert await db.fetchval(record, 3, 2**40 + 1, "b", [12, 13]) == 1
    assert [r[0] for r in await db.fetch(f"SELECT batch FROM {HELD} ORDER BY batch")] == [1, 3]


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "cheap"])
async def test_the_status_counts_a_held_batch_in_flight_not_waiting(
    dsn: str, make_bus: Callable[..., Bus], db: asyncpg.Connection, exact: bool
) -> None:
    from nmbus.admin import Admin
    from nmbus.settings import Settings

    async with make_bus("orders", concurrency=0) as sender:
        await sender.send(Slow(n=1), to="billing")
        await sender.send(Ping(n=2), to="billing")
    live = Worker(dsn, "billing", "10.0")
    try:
        await live.wait_for("ready")
        await live.wait_for("started 1")
        async with Admin.from_settings(Settings(dsn=dsn)) as admin:
            (billing,) = [s for s in await admin.queue_status(exact=exact) if s.queue == "billing"]
        assert (billing.ready, billing.in_flight) == (2, 2)
        assert billing.oldest_ready_seconds is None  # nothing waits for a worker
    finally:
        live.kill()


async def test_a_held_handler_running_past_a_lease_keeps_its_message(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # No lease to renew: the batch's locks and its record keep a rival polling hard
    # away for as long as the handler runs (its timeout bounds the transaction).
    bus = make_bus("billing", held_batches=True, lease_seconds=1.0, handler_timeout=30)
    runs: list[str] = []
    started, done = asyncio.Event(), asyncio.Event()

    @bus.handler
    async def slow(msg: Slow, ctx: Context) -> None:
        runs.append("owner")
        started.set()
        await done.wait()

    rival = rival_of(make_bus, runs)

    async with bus:
        await bus.send(Slow(n=1), to="billing")
        await asyncio.wait_for(started.wait(), 10)
        async with rival:
            await asyncio.sleep(3.0)  # three leases' time, the rival claiming every 0.1 s
            done.set()
            await wait_until("SELECT subqueue FROM nmbus.billing", db=db, until=lambda s: s == "X")
    assert runs == ["owner"]
    row = await db.fetchrow("SELECT retry_count, handling_client_id FROM nmbus.billing")
    assert tuple(row) == (1, None)


async def test_a_backend_ended_under_a_held_batch_stops_its_handlers(
    dsn: str, make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # An operator's pg_terminate_backend (or a failover) ends a held worker's backend:
    # its row locks and its holder lock go, and any worker recovers the batch at its
    # next poll. The handler still running it must stop as soon as its connection is
    # lost, as in a crash, not run on beside the next run.
    async with holding_a_slow_message(dsn, make_bus) as worker:
        ended = await db.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND state = 'idle in transaction'"
        )
        assert ended == 1  # the held batch's backend, in its transaction
        await worker.wait_for("stopped 1", timeout=5)
        # The loop connects again, recovers its own batch as a crash's and runs the
        # message anew, its ended attempt counted: leased now, as a suspect is.
        await worker.wait_for("started 1")
        row = await db.fetchrow("SELECT retry_count, handling_client_id FROM nmbus.billing")
        assert row["retry_count"] == 2 and row["handling_client_id"] is not None
        assert await db.fetchval(f"SELECT count(*) FROM {HELD}") == 0


async def test_a_part_commit_leases_the_messages_waiting_for_a_saga_too(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str
) -> None:
    # A message whose saga another transaction holds waits for it after the
    # first part commits: it must stay this worker's (leased, not let go with the
    # locks) and run once. A hostile review found it let go and run twice.
    bus = make_bus("counting", batch_size=10, held_batches=True, batch_commit_interval=0.05)
    saga = bus.saga(Counter, key="counter")
    handled: list[tuple[str, int, int]] = []

    @saga.handler(start=True)
    async def counted(msg: Increment, state: Counter, ctx: Context) -> None:
        handled.append((msg.counter, msg.n, ctx.retry_count))
        await asyncio.sleep(0.08)

    async with make_bus("counting", concurrency=0) as sender:
        for n, key in enumerate(["free", "free", "free", "taken"]):
            await sender.send(Increment(counter=key, n=n), to="counting")
    async with held_elsewhere(dsn, "Counter", "taken") as taken, bus:
        done = "SELECT count(*) FROM nmbus.counting WHERE subqueue = 'X'"
        await wait_until(done, db=db, until=lambda n: n == 3)
        waiting = await db.fetchrow(
            "SELECT subqueue, handling_client_id FROM nmbus.counting WHERE id = 4"
        )
        assert waiting["subqueue"] == "I" and waiting["handling_client_id"] is not None
        await taken.commit()
        await drain(bus)
    assert sorted(handled) == [("free", 0, 1), ("free", 1, 1), ("free", 2, 1), ("taken", 3, 1)]
    counts = await db.fetch(
        "SELECT subqueue, retry_count, count(*) FROM nmbus.counting GROUP BY 1, 2"
    )
    assert [tuple(r) for r in counts] == [("X", 1, 4)]
    assert await db.fetchval('SELECT count(*) FROM nmbus."counting$held"') == 0


async def test_a_part_commit_that_fails_leaves_nothing_held(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # A deferred constraint fails the part's COMMIT: the rolled-back batch is leased
    # and split as a leased one would be, and nothing stays behind its record.
    await db.execute("CREATE TABLE once (n int UNIQUE DEFERRABLE INITIALLY DEFERRED)")
    await db.execute("INSERT INTO once VALUES (1)")
    async with make_bus("billing", concurrency=0) as sender:
        for n in range(3):
            await sender.send(Ping(n=n), to="billing")
    bus = make_bus(
        "billing", held_batches=True, batch_commit_interval=0.05, max_attempts=3, retry_delay=60
    )
    runs: list[tuple[int, int]] = []

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None:
        runs.append((msg.n, ctx.retry_count))
        if msg.n == 0:
            await ctx.connection.execute("INSERT INTO once VALUES (1)")  # fails at COMMIT
        await asyncio.sleep(0.08)

    async with bus:
        await drain(bus)
    rows = await db.fetch('SELECT subqueue, retry_count FROM nmbus."billing" ORDER BY id')
    assert [tuple(r) for r in rows] == [("R", 1), ("X", 1), ("X", 1)]
    assert await db.fetchval(f"SELECT count(*) FROM {HELD}") == 0


async def test_recovery_counts_the_dead_attempt_of_a_row_a_stale_claim_leased(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # A leased claim whose snapshot predates a record can lock its row once the
    # holder died (its lease then runs). Recovery leaves that lease alone and
    # still counts the attempt that died; a row nobody took becomes a suspect.
    from nmbus.postgres.held import recover_held

    async with make_bus("orders", concurrency=0) as sender:
        await sender.send(Ping(n=1), to="billing")
        await sender.send(Ping(n=2), to="billing")
    taken, free = [r[0] for r in await db.fetch('SELECT id FROM nmbus."billing" ORDER BY id')]
    await db.execute(
        'UPDATE nmbus."billing" SET retry_count = 1, handling_client_id = $2, '
        "lease_expires = now() + interval '1 minute' WHERE id = $1",
        taken,
        "stale-claim",
    )
    gone_holder = 2**40 + 7  # no session holds it
    await db.execute(
        f"INSERT INTO {HELD} (batch, holder, client, ids) VALUES (1, $1, 'dead', $2)",
        gone_holder,
        [taken, free],
    )
    assert await recover_held(db, "nmbus", "billing", 0) == 2
    rows = await db.fetch(
        "SELECT retry_count, handling_client_id, lease_expires > now() AS live "
        'FROM nmbus."billing" ORDER BY id'
    )
    assert [tuple(r) for r in rows] == [(2, "stale-claim", True), (1, "dead", False)]
    assert await db.fetchval(f"SELECT count(*) FROM {HELD}") == 0
    assert await recover_held(db, "nmbus", "billing", 0) == 0  # once


async def test_a_held_batch_claimed_and_never_begun_goes_back_untouched(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # A loop stopped between its claim and its batch (waiting at the process's gate
    # while a suspect runs alone): its session gives the batch back, no record left
    # for a recovery to take as a crash.
    async with make_bus("billing", concurrency=0) as bus:
        await bus.send(Ping(n=1), to="billing")
        async with bus.store.worker_session(None, held=True) as session:
            (claimed,) = await session.claim("billing", 10, "me", 10.0)
            assert await db.fetchval(f"SELECT ids FROM {HELD}") == [claimed.id]
    row = await db.fetchrow('SELECT subqueue, retry_count, handling_client_id FROM nmbus."billing"')
    assert tuple(row) == ("I", 0, None)
    assert await db.fetchval(f"SELECT count(*) FROM {HELD}") == 0


async def test_a_server_idle_timeout_does_not_end_a_held_batch_mid_handler(
    dsn: str, make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # Managed servers often end sessions idle in a transaction; a held batch idles
    # in its own while its handlers run. Its loop turns the timeout off for itself,
    # or a rival would run the message beside the handler still running it.
    database = await db.fetchval("SELECT current_database()")
    await db.execute(f'ALTER DATABASE "{database}" SET idle_in_transaction_session_timeout = 500')
    async with holding_a_slow_message(dsn, make_bus):
        runs: list[str] = []
        async with rival_of(make_bus, runs):
            await asyncio.sleep(2.0)  # four timeouts' time, the rival claiming every 0.1 s
        assert runs == []
        assert await db.fetchval(f"SELECT count(*) FROM {HELD}") == 1
