"""The storage port's contract, run against both adapters.

The worker only relies on what is checked here, so the in-memory store can
stand in for PostgreSQL in unit tests without lying about the semantics.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from nmbus.messages import Envelope
from nmbus.ports.store import SCHEMA_VERSION, Outcomes, Readiness, Store
from nmbus.postgres import PostgresStore
from nmbus.testing import MemoryStore


@pytest.fixture(params=["memory", "postgres"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
        return
    dsn = request.getfixturevalue("dsn")
    pg = PostgresStore(dsn)
    await pg.open()
    try:
        yield pg
    finally:
        await pg.close()


def envelope(n: int, *, uid: str | None = None, at: datetime | None = None) -> Envelope:
    uid = uid or uuid.uuid4().hex
    return Envelope("test.Ping", f'{{"n":{n}}}', None, uid, uid, at)


async def claim(store: Store, limit: int = 10, client: str = "c1", lease: float = 30.0) -> list:
    async with store.worker_session() as session:
        return await session.claim("q", limit, client, lease)


async def finish(store: Store, outcomes: Outcomes, client: str = "c1") -> int:
    async with store.worker_session() as session, session.batch() as tx:
        return await tx.finish("q", outcomes, client)


async def test_insert_skips_known_unique_ids(store: Store) -> None:
    assert await store.insert("q", "me", [envelope(1, uid="a"), envelope(2, uid="b")]) == 2
    assert await store.insert("q", "me", [envelope(3, uid="a")]) == 0
    assert await store.counts("q") == {"I": 2, "R": 0, "X": 0, "F": 0}


async def test_claim_takes_ready_rows_in_order_and_counts_the_attempt(store: Store) -> None:
    await store.insert("q", "me", [envelope(n) for n in range(5)])
    first = await claim(store, limit=3)
    assert [m.msg_text for m in first] == ['{"n":0}', '{"n":1}', '{"n":2}']
    assert {m.retry_count for m in first} == {1}
    assert not any(m.recovered for m in first)
    second = await claim(store, limit=10, client="c2")
    assert [m.msg_text for m in second] == ['{"n":3}', '{"n":4}']
    assert await claim(store) == []  # everything is leased


async def test_scheduled_rows_wait_for_their_time(store: Store) -> None:
    later = datetime.now(UTC) + timedelta(seconds=60)
    await store.insert("q", "me", [envelope(1, at=later)])
    assert await store.counts("q") == {"I": 0, "R": 1, "X": 0, "F": 0}
    assert await claim(store) == []
    async with store.worker_session() as session:
        due = await session.next_due("q")
    assert due is not None and 58 < due <= 60


async def test_past_deliver_at_is_ready_now(store: Store) -> None:
    await store.insert("q", "me", [envelope(1, at=datetime(2001, 1, 1, tzinfo=UTC))])
    assert len(await claim(store)) == 1


async def test_finish_records_each_outcome(store: Store) -> None:
    await store.insert("q", "me", [envelope(n) for n in range(4)])
    ids = [m.id for m in await claim(store)]
    outcomes = Outcomes()
    outcomes.add(ids[0], "X")
    outcomes.add(ids[1], "R", delay=0.0, error_info="ValueError: once")
    outcomes.add(ids[2], "F", error_info="PermanentError: never")
    outcomes.add(ids[3], None, correction=-1)  # released, attempt refunded
    assert await finish(store, outcomes) == 4
    assert await store.counts("q") == {"I": 1, "R": 1, "X": 1, "F": 1}
    again = {m.id: m for m in await claim(store)}
    assert set(again) == {ids[1], ids[3]}
    assert again[ids[1]].retry_count == 2
    assert again[ids[3]].retry_count == 1


async def test_finish_ignores_rows_another_client_holds(store: Store) -> None:
    await store.insert("q", "me", [envelope(1)])
    (row,) = await claim(store, client="c1")
    outcomes = Outcomes()
    outcomes.add(row.id, "X")
    assert await finish(store, outcomes, client="c2") == 0


async def test_an_expired_lease_lets_another_worker_recover_the_row(store: Store) -> None:
    await store.insert("q", "me", [envelope(1)])
    (first,) = await claim(store, client="c1", lease=0.2)
    assert await claim(store, client="c2") == []
    await asyncio.sleep(0.3)
    (again,) = await claim(store, client="c2")
    assert again.id == first.id
    assert again.retry_count == 2 and again.recovered
    outcomes = Outcomes()
    outcomes.add(first.id, "X")
    assert await finish(store, outcomes, client="c1") == 0  # c1 lost it
    assert await finish(store, outcomes, client="c2") == 1


async def test_renew_and_abandon_leases(store: Store) -> None:
    await store.insert("q", "me", [envelope(1), envelope(2)])
    a, b = await claim(store, client="c1", lease=0.3)
    assert (a.claim, b.claim) == ("c1", "c1")  # a claimed row names its claim
    assert await store.renew_leases("q", [a.id], ["c1"], 30.0) == {a.id}
    await store.abandon_leases("q", [b.id], "c1")
    (again,) = await claim(store, client="c2")
    assert again.id == b.id and again.retry_count == 2
    # The first claim's renewal and give-up no longer reach the row another claim took.
    assert await store.renew_leases("q", [b.id], ["c1"], 0.1) == set()
    await store.abandon_leases("q", [b.id], "c1", refund=True)
    await asyncio.sleep(0.4)
    assert await claim(store, client="c3") == []  # a's lease was renewed, b is c2's


async def test_a_crash_s_suspect_let_go_unstarted_is_still_tried_alone(store: Store) -> None:
    # A claim that let go of a row a crash left (a worker stopped before running
    # it) gives its own attempt back, and the row comes back a suspect still: the
    # next claim sees it recovered, so it is tried alone, not in a batch again.
    await store.insert("q", "me", [envelope(1), envelope(2)])
    first, second = await claim(store, client="dead", lease=0.05)
    await asyncio.sleep(0.1)  # the holder died: its lease ran out
    rows = await claim(store, client="c1")
    assert [m.recovered for m in rows] == [2, 2]
    await store.abandon_leases("q", [m.id for m in rows], "c1", refund=True, suspects=[first.id])
    again = {m.id: m for m in await claim(store, client="c2")}
    assert again[first.id].recovered == 1  # still to be tried alone
    assert again[second.id].recovered == 0  # let go as fresh
    assert again[first.id].retry_count == again[second.id].retry_count == 2


async def test_a_batch_given_back_frees_only_the_claims_still_as_they_were(
    store: Store,
) -> None:
    # Rows claimed (attempt 1) and never started go back with that attempt not
    # counted; a row whose lease ran out and that was claimed again since (by
    # another loop of the same process: another claim) is left to its new claim.
    await store.insert("q", "me", [envelope(1), envelope(2)])
    a, b = await claim(store, client="c1", lease=0.2)
    await asyncio.sleep(0.3)
    (taken,) = await claim(store, client="c1b", limit=1)  # b's or a's, claimed again
    kept = next(m for m in (a, b) if m.id != taken.id)
    await store.renew_leases("q", [kept.id], ["c1"], 30.0)  # not lapsed for the other
    given = await store.give_back("q", [a.id, b.id], [a.retry_count, b.retry_count], "c1")
    assert given == [kept.id]
    (again,) = await claim(store, client="c2")
    assert (again.id, again.retry_count, again.recovered) == (kept.id, 1, 0)
    assert await store.give_back("q", [taken.id], [taken.retry_count - 1], "c1b") == []
    assert await claim(store, client="c3") == []  # the new claim still holds it


async def test_a_failed_batch_writes_nothing(store: Store) -> None:
    await store.insert("q", "me", [envelope(1)])
    (row,) = await claim(store)
    await store.ensure_queue("out")
    with pytest.raises(RuntimeError):
        async with store.worker_session() as session, session.batch() as tx:
            await tx.insert("out", "q", [envelope(9)])
            outcomes = Outcomes()
            outcomes.add(row.id, "X")
            await tx.finish("q", outcomes, "c1")
            raise RuntimeError("handler blew up the batch")
    assert await store.counts("out") == {"I": 0, "R": 0, "X": 0, "F": 0}
    assert await store.counts("q") == {"I": 1, "R": 0, "X": 0, "F": 0}


async def test_subscriptions_expire_and_match_type_names(store: Store) -> None:
    await store.subscribe("orders", "billing", ["Event", "OrderPlaced"], ttl=None)
    await store.subscribe("orders", "shipping", ["OrderPlaced"], ttl=0.2)
    await store.subscribe("other", "audit", ["OrderPlaced"], ttl=None)
    assert await store.subscribers("orders", ["OrderPlaced", "Event"]) == ["billing", "shipping"]
    assert await store.subscribers("orders", ["Event"]) == ["billing"]
    await asyncio.sleep(0.3)
    assert await store.subscribers("orders", ["OrderPlaced"]) == ["billing"]
    await store.unsubscribe("orders", "billing", ["OrderPlaced", "Event"])
    assert await store.subscribers("orders", ["OrderPlaced", "Event"]) == []


async def test_queues_are_listed_and_dropped(store: Store) -> None:
    await store.ensure_queue("alpha")
    await store.ensure_queue("beta")
    assert {"alpha", "beta"} <= set(await store.list_queues())
    await store.drop_queue("alpha")
    assert "alpha" not in await store.list_queues()


async def test_readiness_sees_the_schema_version_and_the_queue(store: Store) -> None:
    await store.ensure_queue("alpha")
    assert await store.readiness("alpha") == Readiness(SCHEMA_VERSION, True)
    assert (await store.readiness("alpha")).problem(store.schema, "alpha") is None
    await store.drop_queue("alpha")
    assert await store.readiness("alpha") == Readiness(SCHEMA_VERSION, False)
    assert (await store.readiness("alpha")).problem(store.schema, "alpha") == (
        f"no queue 'alpha' in schema {store.schema!r}"
    )


# -- delivery controls (docs/delivery.md) ---------------------------------------------


def member(n: int, seq: str | None, priority: int = 0) -> Envelope:
    uid = uuid.uuid4().hex
    return Envelope("test.Ping", f'{{"n":{n}}}', None, uid, uid, None, priority, seq)


async def test_the_claim_takes_higher_priorities_first(store: Store) -> None:
    await store.insert("q", "me", [member(0, None), member(1, None, 5), member(2, None, -1)])
    got = await claim(store, limit=10)
    assert [m.msg_text for m in got] == ['{"n":1}', '{"n":0}', '{"n":2}']
    assert [m.priority for m in got] == [5, 0, -1]


async def test_only_the_head_of_a_sequence_is_claimed_until_it_is_in_x(store: Store) -> None:
    await store.insert("q", "me", [member(0, "a"), member(1, "a"), member(2, "b"), member(3, None)])
    first = await claim(store, limit=10)
    assert [m.msg_text for m in first] == ['{"n":0}', '{"n":2}', '{"n":3}']
    assert await claim(store, client="c2") == []  # "a"'s next member waits for its head
    outcomes = Outcomes()
    outcomes.add(first[0].id, "R", delay=0.0, error_info="RuntimeError: again")
    await finish(store, outcomes)
    (again,) = await claim(store, client="c2")  # the head again: R holds the sequence
    assert again.id == first[0].id
    outcomes = Outcomes()
    outcomes.add(again.id, "X")
    await finish(store, outcomes, client="c2")
    (nxt,) = await claim(store, client="c3")
    assert nxt.msg_text == '{"n":1}'


async def test_finishing_a_head_can_claim_its_successor_in_the_same_statement(
    store: Store,
) -> None:
    await store.insert("q", "me", [member(0, "a"), member(1, "a"), member(2, "a")])
    (head,) = await claim(store, limit=10)
    async with store.worker_session() as session, session.batch() as tx:
        failed = Outcomes()
        failed.add(head.id, "F", error_info="PermanentError: no")
        finished, ahead = await tx.finish_and_claim("q", failed, "c1", 10, 30.0, "c1b")
    assert finished == 1 and ahead == []  # F blocks the sequence
    assert await claim(store) == []
    await store.insert("q", "me", [member(10, "b"), member(11, "b")])
    (head,) = await claim(store)
    async with store.worker_session() as session, session.batch() as tx:
        done = Outcomes()
        done.add(head.id, "X")
        finished, ahead = await tx.finish_and_claim("q", done, "c1", 10, 30.0, "c1b")
    # PostgreSQL lets the successor through in the finishing statement; a store
    # that claims nothing ahead hands it to the next claim.
    nxt = ahead or await claim(store)
    assert finished == 1 and [m.msg_text for m in nxt] == ['{"n":11}']


async def test_a_tick_is_inserted_once_per_due_time_even_after_its_row_is_gone(
    store: Store,
) -> None:
    due = datetime(2026, 11, 23, 13, 0, tzinfo=UTC)
    assert await store.insert_tick("q", "hourly", due, envelope(1, uid="t1"))
    assert not await store.insert_tick("q", "hourly", due, envelope(1, uid="t1-again"))
    await store.drop_queue("q")  # the row is gone; the record of its due time is not
    assert not await store.insert_tick("q", "hourly", due, envelope(1, uid="t1-later"))
    earlier = due - timedelta(hours=1)
    assert not await store.insert_tick("q", "hourly", earlier, envelope(0, uid="t0"))
    assert await store.insert_tick("q", "other", earlier, envelope(0, uid="o0"))
    assert await store.insert_tick("q", "hourly", due + timedelta(hours=1), envelope(2, uid="t2"))
    assert await store.counts("q") == {"I": 2, "R": 0, "X": 0, "F": 0}


async def test_a_batch_commits_a_part_and_goes_on_in_a_new_transaction(store: Store) -> None:
    await store.ensure_queue("out")
    await store.insert("q", "me", [envelope(n) for n in range(3)])
    rows = await claim(store)
    outcomes = Outcomes()
    outcomes.processed(rows[0].id)
    outcomes.processed(rows[1].id)
    outcomes.add(rows[2].id, "R", delay=60.0, error_info="ValueError: later")
    async with store.worker_session() as session, session.batch() as tx:
        await tx.insert("out", "q", [envelope(10)])
        part = outcomes.take()
        assert await tx.finish("q", part, "c1") == 3
        await tx.commit()
        # Committed: seen from outside while the batch goes on.
        assert await store.counts("q") == {"I": 0, "R": 1, "X": 2, "F": 0}
        assert (await store.counts("out"))["I"] == 1
        assert len(outcomes) == 0 and outcomes.all_processed
        await tx.insert("out", "q", [envelope(11)])
        assert (await store.counts("out"))["I"] == 1
    assert (await store.counts("out"))["I"] == 2
    assert part.subqueue == ["X", "X", "R"] and not part.all_processed
    assert part.error_info == [None, None, "ValueError: later"]
