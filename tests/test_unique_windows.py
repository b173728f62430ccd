"""Unique windows: a unique_id that holds only while its message waits
(``unique_while="pending"``) or for some seconds after its send (``unique_for``)."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import replace
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

from nmbus import Bus
from nmbus.envelopes import outgoing
from nmbus.errors import InvalidMessage
from nmbus.ports.operations import RetentionPolicy
from nmbus.ports.store import SCHEMA_VERSION
from nmbus.postgres import install_schema
from nmbus.postgres.retention import clean_queue
from nmbus.postgres.segments import advance
from nmbus.testing import MemoryStore
from tests.messages import Ping
from tests.segment_rows import make_queue

Q = "uniqwin"
PENDING = json.dumps({"nmbus-unique-while": "pending"})
# What a send with unique_while="pending" inserts, as one statement on any connection.
INSERT = (
    f"INSERT INTO nmbus.{Q} (from_endpoint, to_endpoint, label, msg_text, msg_headers, "
    "unique_id) VALUES ('shop', $1, 'test.Ping', '{\"n\": 1}', $2::jsonb, $3)"
)


async def count(db: asyncpg.Connection, uid: str, queue: str = Q) -> int:
    return int(await db.fetchval(f"SELECT count(*) FROM nmbus.{queue} WHERE unique_id = $1", uid))


async def finish(db: asyncpg.Connection, uid: str, subqueue: str, queue: str = Q) -> None:
    """The waiting row of ``uid`` processed (X) or failed (F), as a worker leaves it."""
    await db.execute(
        f"UPDATE nmbus.{queue} SET subqueue = $2, last_processed = now() "
        "WHERE unique_id = $1 AND subqueue IN ('I', 'R')",
        uid,
        subqueue,
    )


# -- the rules -----------------------------------------------------------------------------


@pytest.mark.parametrize("done", ["X", "F"])
async def test_pending_holds_while_waiting_and_frees_once_done(
    dsn: str, db: asyncpg.Connection, done: str
) -> None:
    async with Bus("shop", dsn=dsn, concurrency=0) as bus:
        await bus.send(Ping(n=1), to=Q, unique_id="inv-7", unique_while="pending")
        await bus.send(Ping(n=2), to=Q, unique_id="inv-7", unique_while="pending")
        assert await count(db, "inv-7") == 1  # waiting in I: the second send is skipped
        await db.execute(f"UPDATE nmbus.{Q} SET subqueue = 'R' WHERE unique_id = 'inv-7'")
        await bus.send(Ping(n=3), to=Q, unique_id="inv-7", unique_while="pending")
        assert await count(db, "inv-7") == 1  # R is waiting too
        await finish(db, "inv-7", done)
        await bus.send(Ping(n=4), to=Q, unique_id="inv-7", unique_while="pending")
        rows = await db.fetch(
            f"SELECT subqueue, msg_text FROM nmbus.{Q} WHERE unique_id = 'inv-7' ORDER BY id"
        )
        assert [(r["subqueue"], json.loads(r["msg_text"])["n"]) for r in rows] == [
            (done, 1),
            ("I", 4),
        ]
        # The new row holds the id now, for as long as it waits.
        await bus.send(Ping(n=5), to=Q, unique_id="inv-7", unique_while="pending")
        assert await count(db, "inv-7") == 2


async def test_unique_for_holds_for_its_seconds_after_the_first_send(
    dsn: str, db: asyncpg.Connection
) -> None:
    async with Bus("shop", dsn=dsn, concurrency=0) as bus:
        await bus.send(Ping(n=1), to=Q, unique_id="day", unique_for=3600)
        await finish(db, "day", "X")
        await bus.send(Ping(n=2), to=Q, unique_id="day", unique_for=3600)
        assert await count(db, "day") == 1  # done, yet within the hour: skipped
        entry = await db.fetchrow(
            f'SELECT u.until - q.insert_time AS span FROM nmbus."{Q}$unique" AS u '
            f"JOIN nmbus.{Q} AS q ON q.id = u.id WHERE u.unique_id = 'day'"
        )
        assert entry["span"] == timedelta(hours=1)

        await bus.send(Ping(n=3), to=Q, unique_id="short", unique_for=0.5)
        await bus.send(Ping(n=4), to=Q, unique_id="short", unique_for=0.5)
        assert await count(db, "short") == 1  # still waiting, and within its window
        await asyncio.sleep(0.6)  # past the window (the rule, not a timing, is checked)
        await bus.send(Ping(n=5), to=Q, unique_id="short", unique_for=0.5)
        assert await count(db, "short") == 2  # over: stored, though the first still waits


async def test_without_a_window_a_unique_id_holds_while_its_row_is_kept(
    dsn: str, db: asyncpg.Connection
) -> None:
    async with Bus("shop", dsn=dsn, concurrency=0) as bus:
        await bus.send(Ping(n=1), to=Q, unique_id="plain")
        await finish(db, "plain", "X")
        await bus.send(Ping(n=2), to=Q, unique_id="plain")
        await bus.send(Ping(n=3), to=Q, unique_id="plain", unique_while="pending")
        await bus.send(Ping(n=4), to=Q, unique_id="plain", unique_for=1)
        assert await count(db, "plain") == 1
        entry = await db.fetchrow(f'SELECT until, pending FROM nmbus."{Q}$unique"')
        assert (entry["until"], entry["pending"]) == (None, None)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"unique_while": "pending"}, "need a unique_id"),
        ({"unique_for": 60}, "need a unique_id"),
        ({"unique_id": "k", "unique_while": "pending", "unique_for": 60}, "not both"),
        ({"unique_id": "k", "unique_while": "done"}, "must be 'pending'"),
        ({"unique_id": "k", "unique_while": True}, "must be 'pending'"),
        ({"unique_id": "k", "unique_for": 0}, "above 0"),
        ({"unique_id": "k", "unique_for": -5}, "above 0"),
        ({"unique_id": "k", "unique_for": float("inf")}, "above 0"),
        ({"unique_id": "k", "unique_for": float("nan")}, "above 0"),
        ({"unique_id": "k", "unique_for": 10**12}, "above 0"),
        ({"unique_id": "k", "unique_for": "60"}, "above 0"),
        ({"unique_id": "k", "unique_for": True}, "above 0"),
    ],
)
async def test_a_wrong_window_is_refused_at_send_and_publish(
    options: dict[str, Any], message: str
) -> None:
    store = MemoryStore()
    async with Bus("shop", store=store, concurrency=0) as bus:
        with pytest.raises(InvalidMessage, match=message):
            await bus.send(Ping(n=1), to="billing", **options)
        with pytest.raises(InvalidMessage, match=message):
            await bus.publish(Ping(n=1), **options)
        assert "billing" not in store.tables


async def test_a_publish_copy_keeps_the_window_in_each_subscriber_queue(
    dsn: str, db: asyncpg.Connection
) -> None:
    sub = Bus(f"{Q}_sub", dsn=dsn, concurrency=0)
    sub.subscribe(Ping, publisher="shop")
    async with sub, Bus("shop", dsn=dsn, concurrency=0) as bus:
        await bus.publish(Ping(n=1), unique_id="p", unique_while="pending")
        await bus.publish(Ping(n=2), unique_id="p", unique_while="pending")
        assert await count(db, f"p/{Q}_sub", f"{Q}_sub") == 1
        await finish(db, f"p/{Q}_sub", "X", f"{Q}_sub")
        await bus.publish(Ping(n=3), unique_id="p", unique_while="pending")
        assert await count(db, f"p/{Q}_sub", f"{Q}_sub") == 2


# -- races ---------------------------------------------------------------------------------


async def test_two_senders_at_once_store_one_row(dsn: str, db: asyncpg.Connection) -> None:
    async with Bus("shop", dsn=dsn, concurrency=0) as bus:
        await bus.send(Ping(n=1), to=Q, unique_id="race", unique_while="pending")
        await finish(db, "race", "X")
        # The first takes the freed id in an open transaction: the second waits on it,
        # then sees the first's waiting row and is skipped.
        first, second = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
        try:
            tx = first.transaction()
            await tx.start()
            assert await first.execute(INSERT, Q, PENDING, "race") == "INSERT 0 1"
            later = asyncio.create_task(second.execute(INSERT, Q, PENDING, "race"))
            await asyncio.sleep(0.3)
            assert not later.done()
            await tx.commit()
            assert await later == "INSERT 0 0"
        finally:
            await first.close()
            await second.close()
        assert await count(db, "race") == 2

        # Many sends of a freed id at once, on the pool's connections: one is stored.
        await finish(db, "race", "F")
        await asyncio.gather(
            *(
                bus.send(Ping(n=n), to=Q, unique_id="race", unique_while="pending")
                for n in range(12)
            )
        )
        assert await count(db, "race") == 3
        await bus.send(Ping(n=99), to=Q, unique_id="burst", unique_for=3600)
        await finish(db, "burst", "X")
        await asyncio.gather(
            *(bus.send(Ping(n=n), to=Q, unique_id="burst", unique_for=3600) for n in range(12))
        )
        assert await count(db, "burst") == 1


async def _waiting_on_a_lock(db: asyncpg.Connection, pid: int) -> bool:
    """Whether backend ``pid`` is waiting for a lock (not running, not idle)."""
    return bool(
        await db.fetchval(
            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid
        )
    )


@pytest.mark.parametrize("window", ["pending", "for"])
async def test_an_entry_deleted_while_a_send_waits_to_lock_it_is_taken(
    dsn: str, db: asyncpg.Connection, window: str
) -> None:
    """A send finds the id's entry at its insert, then waits to lock it; the row that
    held it is deleted (a purge, retention) and the entry with it. Nothing holds the
    id any more: the send stores its row, taking the id."""
    await make_queue(dsn, Q)
    headers = PENDING if window == "pending" else json.dumps({"nmbus-unique-for": 3600})
    await _deleted_while_a_send_waits(dsn, db, headers)


async def _deleted_while_a_send_waits(dsn: str, db: asyncpg.Connection, headers: str) -> None:
    await db.execute(INSERT, Q, headers, "gone")
    holder = await db.fetchval(f"SELECT id FROM nmbus.{Q} WHERE unique_id = 'gone'")
    purger, sender = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    try:
        tx = purger.transaction()
        await tx.start()
        # The purge has the entry locked: the send's insert sees it and does nothing,
        # then its lock of the entry waits.
        await purger.execute(
            f'SELECT 1 FROM nmbus."{Q}$unique" WHERE unique_id = $1 FOR UPDATE', "gone"
        )
        pid = sender.get_server_pid()
        sent = asyncio.create_task(sender.execute(INSERT, Q, headers, "gone"))
        for _ in range(200):
            if await _waiting_on_a_lock(db, pid):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the send never waited on the entry's lock")
        assert not sent.done()
        await purger.execute(f"DELETE FROM nmbus.{Q} WHERE id = $1", holder)
        await tx.commit()
        assert await asyncio.wait_for(sent, 10) == "INSERT 0 1"
    finally:
        await purger.close()
        await sender.close()
    rows = await db.fetch(f"SELECT id FROM nmbus.{Q} WHERE unique_id = 'gone'")
    assert len(rows) == 1 and rows[0]["id"] != holder
    # The new row holds the id: a send of it now is skipped.
    await db.execute(INSERT, Q, headers, "gone")
    assert await count(db, "gone") == 1
    entry = await db.fetchval(f'SELECT id FROM nmbus."{Q}$unique" WHERE unique_id = $1', "gone")
    assert entry == rows[0]["id"]


@pytest.mark.parametrize("window", ["pending", "for", None])
async def test_two_batches_of_the_same_ids_in_opposite_orders_do_not_deadlock(
    dsn: str, db: asyncpg.Connection, window: str | None
) -> None:
    """Two senders store one batch each, in one statement, of the same unique ids in
    opposite orders, at once: each takes the ids' entries in the same order, so
    neither waits on the other while holding what it waits for. Round 0 takes new
    ids; every later round takes ids whose window is over (rows done, time passed)."""
    options: dict[str, Any] = {"pending": {"unique_while": "pending"}, "for": {"unique_for": 60}}
    ids = [f"pair-{n:02d}" for n in range(40)]
    async with Bus("shop", dsn=dsn, concurrency=0) as bus:
        await bus.send(Ping(n=0), to=Q)  # the queue's table

        def batch(order: list[str]) -> list[Any]:
            return [
                bus.envelopes.for_send(
                    Ping(n=n), Q, outgoing({"unique_id": uid, **options.get(window or "", {})})
                )
                for n, uid in enumerate(order)
            ]

        forward, backward = batch(ids), batch(ids[::-1])
        first, second = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
        try:
            for round_ in range(30):
                stored = await asyncio.gather(
                    bus.store.insert(Q, "shop", forward, first),
                    bus.store.insert(Q, "shop", backward, second),
                )
                waiting = await db.fetch(
                    f"SELECT unique_id, count(*) AS n FROM nmbus.{Q} "
                    "WHERE subqueue = 'I' AND unique_id LIKE 'pair-%' GROUP BY 1"
                )
                if window is None and round_ > 0:
                    assert stored == [0, 0] and waiting == []  # held for as long as kept
                    continue
                assert sum(stored) == len(ids), (round_, stored)
                assert sorted((r["unique_id"], r["n"]) for r in waiting) == [
                    (uid, 1) for uid in ids
                ]
                await finish_all(db)
        finally:
            await first.close()
            await second.close()


async def test_a_batch_keeps_its_send_order_whatever_its_unique_ids(
    dsn: str, db: asyncpg.Connection
) -> None:
    """Rows are inserted in unique_id order, but their ids follow the batch's order,
    so they are claimed in send order, and a sequence's members in theirs."""
    uids = ["zz", "mm", "aa", "yy", "bb"]
    async with Bus("shop", dsn=dsn, concurrency=0) as bus:
        await bus.send(Ping(n=-1), to=Q)  # the queue's table
        envelopes = [
            bus.envelopes.for_send(Ping(n=n), Q, outgoing({"unique_id": uid, **extra}))
            for n, uid in enumerate(uids)
            for extra in ({"sequence": "s"} if n % 2 else {},)
        ]
        assert await bus.store.insert(Q, "shop", envelopes) == len(uids)
    rows = await db.fetch(
        f"SELECT unique_id, retry_time = 'infinity' AS parked FROM nmbus.{Q} "
        "WHERE unique_id = ANY($1::text[]) ORDER BY id",
        uids,
    )
    assert [r["unique_id"] for r in rows] == uids
    # The second member of the sequence waits behind the first.
    assert [r["parked"] for r in rows] == [False, False, False, True, False]


async def finish_all(db: asyncpg.Connection) -> None:
    """Every waiting row processed, and every unique_for window over."""
    await db.execute(
        f"UPDATE nmbus.{Q} SET subqueue = 'X', last_processed = now() WHERE subqueue = 'I'"
    )
    await db.execute(
        f"UPDATE nmbus.\"{Q}$unique\" SET until = now() - interval '1 second' "
        "WHERE until IS NOT NULL"
    )


SENDER = """
import asyncio, sys
from nmbus import Bus
from tests.messages import Ping

async def main() -> None:
    async with Bus("shop", dsn=sys.argv[1], concurrency=0) as bus:
        sys.stdin.readline()
        for n in range(20):
            await bus.send(Ping(n=n), to=sys.argv[2], unique_id="proc-" + str(n),
                           unique_while="pending")

asyncio.run(main())
"""


async def test_two_processes_sending_the_same_ids_store_each_once(
    dsn: str, db: asyncpg.Connection
) -> None:
    async with Bus("shop", dsn=dsn, concurrency=0) as bus:
        for n in range(20):
            await bus.send(Ping(n=n), to=Q, unique_id=f"proc-{n}", unique_while="pending")
    await db.execute(f"UPDATE nmbus.{Q} SET subqueue = 'X', last_processed = now()")
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", SENDER, dsn, Q, stdin=asyncio.subprocess.PIPE
        )
        for _ in range(2)
    ]
    await asyncio.sleep(1.0)  # both connected and waiting: they start at once
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(b"go\n")
        p.stdin.close()
    codes = await asyncio.gather(*(asyncio.wait_for(p.wait(), 60) for p in procs))
    assert codes == [0, 0]
    waiting = await db.fetch(
        f"SELECT unique_id, count(*) AS n FROM nmbus.{Q} WHERE subqueue = 'I' GROUP BY 1"
    )
    assert sorted((r["unique_id"], r["n"]) for r in waiting) == sorted(
        (f"proc-{n}", 1) for n in range(20)
    )


# -- segments ------------------------------------------------------------------------------


async def test_a_dropped_segment_keeps_an_unexpired_window_and_frees_a_done_one(
    dsn: str, db: asyncpg.Connection
) -> None:
    await make_queue(dsn, Q)
    async with Bus("shop", dsn=dsn, concurrency=0) as bus:
        await bus.send(Ping(n=1), to=Q, unique_id="for", unique_for=3600)
        await bus.send(Ping(n=2), to=Q, unique_id="while", unique_while="pending")
        await bus.send(Ping(n=3), to=Q, unique_id="expired", unique_for=3600)
        await db.execute(
            f"UPDATE nmbus.\"{Q}$unique\" SET until = now() - interval '1 second' "
            "WHERE unique_id = 'expired'"
        )
        await db.execute(
            f"UPDATE nmbus.{Q} SET subqueue = 'X', last_processed = now() - interval '2 days'"
        )
        assert await advance(db, "nmbus", Q) == 1
        result = await clean_queue(db, "nmbus", Q, RetentionPolicy(max_age=timedelta(days=1)))
        assert result.deleted["X"] == 3 and result.segments_dropped >= 1
        assert await db.fetchval(f"SELECT count(*) FROM nmbus.{Q}") == 0
        kept = await db.fetch(f'SELECT unique_id FROM nmbus."{Q}$unique"')
        assert [r["unique_id"] for r in kept] == ["for"]
        for uid, window in (
            ("for", {"unique_for": 3600}),
            ("while", {"unique_while": "pending"}),
            ("expired", {"unique_for": 3600}),
        ):
            await bus.send(Ping(n=4), to=Q, unique_id=uid, **window)
        assert [await count(db, u) for u in ("for", "while", "expired")] == [0, 1, 1]


async def test_moving_rows_to_a_newer_segment_keeps_them_and_the_holder(
    dsn: str, db: asyncpg.Connection
) -> None:
    await make_queue(dsn, Q)
    async with Bus("shop", dsn=dsn, concurrency=0) as bus:
        await bus.send(Ping(n=1), to=Q, unique_id="mv", unique_while="pending")
        await finish(db, "mv", "F")  # a young F row: it waits, and moves on
        await db.execute(
            f"INSERT INTO nmbus.{Q} (from_endpoint, to_endpoint, subqueue, last_processed) "
            "VALUES ('a', 'b', 'X', now() - interval '2 days')"
        )
        assert await advance(db, "nmbus", Q) == 1
        # In the segment now written: the row that holds the id.
        await bus.send(Ping(n=2), to=Q, unique_id="mv", unique_while="pending")
        policy = RetentionPolicy(max_age=timedelta(days=1), failed_max_age=timedelta(days=7))
        result = await clean_queue(db, "nmbus", Q, policy)
        assert result.rows_moved == 1 and result.segments_dropped == 1
        rows = await db.fetch(f"SELECT id, subqueue FROM nmbus.{Q} WHERE unique_id = 'mv'")
        assert sorted(r["subqueue"] for r in rows) == ["F", "I"]  # the moved row is kept
        holder = await db.fetchval(f'SELECT id FROM nmbus."{Q}$unique" WHERE unique_id = $1', "mv")
        assert holder == next(r["id"] for r in rows if r["subqueue"] == "I")
        await bus.send(Ping(n=3), to=Q, unique_id="mv", unique_while="pending")
        assert await count(db, "mv") == 2  # the waiting row still holds it


# -- upgrade -------------------------------------------------------------------------------


OLD_FUNCTION = """
CREATE OR REPLACE FUNCTION nmbus."{q}$unique"() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    IF TG_OP = 'DELETE' THEN
        DELETE FROM nmbus."{q}$unique" WHERE unique_id = OLD.unique_id AND id = OLD.id;
        RETURN OLD;
    END IF;
    INSERT INTO nmbus."{q}$unique" (unique_id, id) VALUES (NEW.unique_id, NEW.id)
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END
$fn$
"""


async def test_a_version_13_database_upgrades_and_keeps_its_unique_ids(
    dsn: str, db: asyncpg.Connection
) -> None:
    await make_queue(dsn, Q)
    # What version 13 had: entries without a window, and the trigger that knew none.
    await db.execute(f'ALTER TABLE nmbus."{Q}$unique" DROP COLUMN until, DROP COLUMN pending')
    await db.execute(OLD_FUNCTION.replace("{q}", Q))
    await db.execute("DELETE FROM nmbus.schema_version")
    await db.execute("INSERT INTO nmbus.schema_version (version) VALUES (13)")
    await db.execute(INSERT, Q, None, "old")
    await finish(db, "old", "X")

    await install_schema(db, "nmbus")

    assert SCHEMA_VERSION >= 14
    assert await db.fetchval("SELECT max(version) FROM nmbus.schema_version") == SCHEMA_VERSION
    async with Bus("shop", dsn=dsn, concurrency=0) as bus:
        await bus.send(Ping(n=1), to=Q, unique_id="old", unique_while="pending")
        assert await count(db, "old") == 1  # an entry from before holds as it did
        await bus.send(Ping(n=2), to=Q, unique_id="new", unique_while="pending")
        await finish(db, "new", "X")
        await bus.send(Ping(n=3), to=Q, unique_id="new", unique_while="pending")
        assert await count(db, "new") == 2


async def test_a_version_14_database_gets_the_trigger_that_inserts_again(
    dsn: str, db: asyncpg.Connection
) -> None:
    await make_queue(dsn, Q)
    # An earlier trigger, that drops a row whenever its insert finds an entry.
    await db.execute(OLD_FUNCTION.replace("{q}", Q))
    await db.execute("DELETE FROM nmbus.schema_version")
    await db.execute("INSERT INTO nmbus.schema_version (version) VALUES (14)")

    await install_schema(db, "nmbus")

    assert await db.fetchval("SELECT max(version) FROM nmbus.schema_version") == SCHEMA_VERSION
    await _deleted_while_a_send_waits(dsn, db, PENDING)


# -- the memory store ----------------------------------------------------------------------


async def test_the_memory_store_keeps_the_same_windows() -> None:
    store = MemoryStore()
    async with Bus("shop", store=store, concurrency=0) as bus:
        await bus.send(Ping(n=1), to="billing", unique_id="w", unique_while="pending")
        await bus.send(Ping(n=2), to="billing", unique_id="w", unique_while="pending")
        await bus.send(Ping(n=1), to="billing", unique_id="f", unique_for=3600)
        await bus.send(Ping(n=1), to="billing", unique_id="s", unique_for=0.3)
        await bus.send(Ping(n=1), to="billing", unique_id="p")
        assert len(store.rows("billing")) == 4
        for row in store.rows("billing"):
            store.tables["billing"][row.id] = replace(row, subqueue="X")
        await asyncio.sleep(0.4)
        for uid, window in (
            ("w", {"unique_while": "pending"}),
            ("f", {"unique_for": 3600}),
            ("s", {"unique_for": 0.3}),
            ("p", {}),
        ):
            await bus.send(Ping(n=3), to="billing", unique_id=uid, **window)
        counts = {u: sum(r.unique_id == u for r in store.rows("billing")) for u in "wfsp"}
        assert counts == {"w": 2, "f": 1, "s": 2, "p": 1}
