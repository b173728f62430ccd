"""The ready floor: the worker's statements leave out the segments that hold nothing for them.

docs/storage.md, "Plans over segments"; nmbus/postgres/floor.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from nmbus import Bus, Context, PermanentError
from nmbus.postgres.floor import NO_FLOOR, REFRESH_SECONDS, ReadyFloors, read_floor
from nmbus.postgres.segments import advance
from nmbus.postgres.sql import SEGMENT_SPAN, render
from nmbus.postgres.store import WORKER_SERVER_SETTINGS
from tests.messages import Ping
from tests.segment_rows import add, make_queue
from tests.waits import wait_until


async def floor_segment(db: asyncpg.Connection) -> int:
    floor = await read_floor(db, "nmbus", "billing")
    return 0 if floor == NO_FLOOR else floor // SEGMENT_SPAN


async def first_id(db: asyncpg.Connection, segment: int) -> int:
    return int(
        await db.fetchval(
            "SELECT min(id) FROM nmbus.billing WHERE id >= $1 AND id < $2",
            segment * SEGMENT_SPAN if segment else NO_FLOOR,
            (segment + 1) * SEGMENT_SPAN,
        )
    )


async def three_segments_of_x(db: asyncpg.Connection, dsn: str) -> None:
    await make_queue(dsn)
    for segment in (1, 2):
        await add(db, 5, "X", prefix=f"s{segment}")
        assert await advance(db, "nmbus", "billing") == segment


async def test_the_floor_is_the_lowest_segment_holding_ready_rows_or_sequence_members(
    dsn: str, db: asyncpg.Connection
) -> None:
    await make_queue(dsn)
    assert await read_floor(db, "nmbus", "billing") == NO_FLOOR  # segment 0: every id
    await add(db, 5, "X", prefix="s0")
    assert await advance(db, "nmbus", "billing") == 1
    await add(db, 5, "X", prefix="s1")
    assert await advance(db, "nmbus", "billing") == 2
    # Nothing ready: the segment being written.
    assert await floor_segment(db) == 2
    await add(db, 1, "F", prefix="failed")  # F rows wait for an operator, not a worker
    assert await floor_segment(db) == 2

    # A leased row of segment 1 holds the floor there (it is still I until finished).
    leased = await first_id(db, 1)
    await db.execute(
        "UPDATE nmbus.billing SET subqueue = 'I', handling_client_id = 'w', "
        "lease_expires = now() + interval '1 minute' WHERE id = $1",
        leased,
    )
    assert await floor_segment(db) == 1
    # So does a scheduled retry.
    await db.execute(
        "UPDATE nmbus.billing SET subqueue = 'R', handling_client_id = NULL, "
        "lease_expires = NULL, retry_time = now() + interval '1 day' WHERE id = $1",
        leased,
    )
    assert await floor_segment(db) == 1
    await db.execute("UPDATE nmbus.billing SET subqueue = 'X' WHERE id = $1", leased)
    assert await floor_segment(db) == 2

    # A failed member of a sequence in segment 0 holds its sequence back: the floor
    # keeps segment 0 in the claim's probe of sequence heads.
    await db.execute(
        "UPDATE nmbus.billing SET subqueue = 'F', sequence_key = 'k' WHERE id = $1",
        await first_id(db, 0),
    )
    assert await read_floor(db, "nmbus", "billing") == NO_FLOOR


async def test_the_worker_s_statements_leave_the_segments_below_the_floor_out(
    dsn: str, db: asyncpg.Connection
) -> None:
    await make_queue(dsn)
    for segment in range(1, 6):
        await add(db, 200, "X", prefix=f"s{segment}")
        assert await advance(db, "nmbus", "billing") == segment
    await add(db, 300, "I", ago="0 seconds")
    await db.execute("ANALYZE nmbus.billing")
    floor = await read_floor(db, "nmbus", "billing")
    assert floor == 5 * SEGMENT_SPAN
    worker = await asyncpg.connect(dsn, server_settings=WORKER_SERVER_SETTINGS)
    try:
        rows = await worker.fetch(render("claim", "nmbus", "billing"), 100, "w", 30.0, floor)
        claimed = [r["id"] for r in rows]
        assert len(claimed) == 100
        statements = {
            "claim": f"100, 'w', 30.0, {floor}",
            "finish_claim_processed": f"ARRAY{claimed}::bigint[], 'w', 100, 30.0, {floor}, 'w2'",
            "finish_claim": (
                f"ARRAY{claimed}::bigint[], ARRAY{['X'] * 100}::text[], "
                f"ARRAY{[0.0] * 100}::float8[], ARRAY{[None] * 100}::text[], "
                f"ARRAY{[0] * 100}::int[], 'w', 100, 30.0, {floor}, 'w2'"
            ).replace("None", "NULL"),
        }
        for name, args in statements.items():
            await worker.execute(f"PREPARE {name} AS {render(name, 'nmbus', 'billing')}")
            await worker.execute("BEGIN")
            try:
                plan = "\n".join(
                    r[0] for r in await worker.fetch(f"EXPLAIN (ANALYZE) EXECUTE {name}({args})")
                )
            finally:
                await worker.execute("ROLLBACK")
            # Pruned when the statement starts: no old segment is read, nor even opened.
            assert "Subplans Removed" in plan, plan
            scans = [line for line in plan.splitlines() if " Scan " in line]
            for old in range(5):
                assert not [s for s in scans if f'"billing$s{old}"' in s], (name, plan)
            assert [s for s in scans if '"billing$s5"' in s], plan
    finally:
        await worker.close()


async def test_a_row_requeued_below_the_floor_by_hand_is_handled(
    dsn: str, db: asyncpg.Connection
) -> None:
    await three_segments_of_x(db, dsn)
    await add(db, 1, "F", prefix="old")  # in segment 2
    assert await advance(db, "nmbus", "billing") == 3
    old = await db.fetchval("SELECT id FROM nmbus.billing WHERE subqueue = 'F'")
    handled: list[int] = []
    bus = Bus("billing", dsn=dsn, poll_interval=0.2)

    @bus.handler(Ping)
    async def on_ping(msg: Ping, ctx: Context) -> None:
        handled.append(msg.n)

    async with bus, Bus("shop", dsn=dsn, concurrency=0) as sender:
        for n in range(3):
            await sender.send(Ping(n=n), to="billing")
        await wait_until(lambda: len(handled) == 3, timeout=10)
        assert await floor_segment(db) == 3  # nothing waits below the segment written
        # Seed 003's requeue, by hand, of the old F row.
        await db.execute("UPDATE nmbus.billing SET subqueue = 'I' WHERE id = $1", old)
        await wait_until(lambda: len(handled) == 4, timeout=10)
    assert await db.fetchval("SELECT subqueue FROM nmbus.billing WHERE id = $1", old) == "X"


async def test_a_sequence_held_back_in_an_old_segment_stays_in_order(
    dsn: str, db: asyncpg.Connection
) -> None:
    handled: list[int] = []
    fail = {0}
    bus = Bus("billing", dsn=dsn, poll_interval=0.2)

    @bus.handler(Ping)
    async def on_ping(msg: Ping, ctx: Context) -> None:
        if msg.n in fail:
            raise PermanentError("not yet")
        handled.append(msg.n)

    await make_queue(dsn)
    async with bus, Bus("shop", dsn=dsn, concurrency=0) as sender:
        await sender.send(Ping(n=0), to="billing", sequence="k")
        await wait_until("SELECT count(*) FROM nmbus.billing WHERE subqueue = 'F'", db=db)
        # The failed head stays in segment 0 while the queue moves on.
        for segment in (1, 2):
            await add(db, 5, "X", prefix=f"s{segment}")
            assert await advance(db, "nmbus", "billing") == segment
        await sender.send(Ping(n=1), to="billing", sequence="k")  # behind the F head
        # Due at once, as a send racing its head's finish can leave it: only the
        # claim's probe of the head, which must reach down to segment 0, holds it.
        await db.execute(
            "UPDATE nmbus.billing SET retry_time = now() WHERE sequence_key = 'k' "
            "AND subqueue = 'I'"
        )
        assert await read_floor(db, "nmbus", "billing") == NO_FLOOR
        await asyncio.sleep(REFRESH_SECONDS + 0.2)  # the worker has read the floor again
        await sender.send(Ping(n=2), to="billing")
        await wait_until(lambda: handled == [2], timeout=10)
        await asyncio.sleep(0.5)
        assert handled == [2]
        fail.clear()
        await db.execute("UPDATE nmbus.billing SET subqueue = 'I' WHERE subqueue = 'F'")
        await wait_until(lambda: len(handled) == 3, timeout=10)
    assert handled == [2, 0, 1]  # the member sent later never overtook the head


async def test_loops_share_one_floor_and_read_it_again_when_stale(
    dsn: str, db: asyncpg.Connection
) -> None:
    await three_segments_of_x(db, dsn)
    floors = ReadyFloors("nmbus", refresh=60.0)
    assert floors.cached("billing") == NO_FLOOR and floors.stale("billing")
    assert await floors.floor(db, "billing") == 2 * SEGMENT_SPAN
    await db.execute("UPDATE nmbus.billing SET subqueue = 'I' WHERE id = $1", await first_id(db, 0))
    assert await floors.floor(db, "billing") == 2 * SEGMENT_SPAN  # not stale yet
    floors.forget("billing")
    assert await floors.floor(db, "billing") == NO_FLOOR


async def test_a_stale_floor_is_read_again_off_the_loops_connection(
    dsn: str, db: asyncpg.Connection
) -> None:
    await three_segments_of_x(db, dsn)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    acquired = 0

    def connection() -> Any:
        nonlocal acquired
        acquired += 1
        return pool.acquire()

    try:
        floors = ReadyFloors("nmbus", refresh=0.2, connection=connection)
        assert await floors.floor(db, "billing") == 2 * SEGMENT_SPAN  # the first: inline
        assert acquired == 0
        await db.execute(
            "UPDATE nmbus.billing SET subqueue = 'I' WHERE id = $1", await first_id(db, 0)
        )
        await asyncio.sleep(0.25)
        # Stale: the loop goes on with the floor it has, at once, without a query on
        # its connection (a closed one would raise), while the pool reads it again.
        closed = await asyncpg.connect(dsn)
        await closed.close()
        assert await floors.floor(closed, "billing") == 2 * SEGMENT_SPAN
        assert await floors.floor(closed, "billing") == 2 * SEGMENT_SPAN
        await wait_until(lambda: floors.cached("billing") == NO_FLOOR, timeout=10)
        assert acquired == 1  # one read, however many claims found it stale meanwhile
        assert await floors.floor(closed, "billing") == NO_FLOOR
    finally:
        await pool.close()
