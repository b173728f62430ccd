"""Which waiting batch goes first for a saga (nmbus/sagas/locks.py, _waits).

The loops of one process wait for each other in memory before they take their
sagas in PostgreSQL. Two batches may hold messages of two sagas crossed (a1
and b4 against a2 and b3): were each to wait for the other's older message,
the loops would hang. These look at the rule itself, with the places the
batches' first pass records; tests/test_saga_batches.py runs it on PostgreSQL.
"""

from __future__ import annotations

from typing import cast

from nmbus.handlers import Registry
from nmbus.ports.store import Batch, SagaKey
from nmbus.sagas.locks import SagaLocks

A: SagaKey = ("Counter", "a")
B: SagaKey = ("Counter", "b")
C: SagaKey = ("Counter", "c")


def waiting(*batches: tuple[int, dict[SagaKey, int]]) -> tuple[SagaLocks, list[Batch]]:
    """A process whose batches wait, each with its oldest message left for later
    and its oldest message of each saga it waits for."""
    locks = SagaLocks(Registry())
    txs = [cast("Batch", object()) for _ in batches]
    for tx, (place, firsts) in zip(txs, batches, strict=True):
        locks._orders[id(tx)] = (place, firsts)
        locks._wants[id(tx)] = set(firsts)
    return locks, txs


def test_of_two_batches_crossed_on_two_sagas_only_the_newer_waits() -> None:
    locks, (x, y) = waiting((1, {A: 1, B: 4}), (2, {A: 2, B: 3}))
    assert not locks._waits_for_another(x)
    assert locks._waits_for_another(y)


def test_three_batches_crossed_in_a_ring_leave_one_free_to_go() -> None:
    # Were each saga's order followed alone, X would wait for Y (a1 before a4), Y
    # for Z (b2 before b6) and Z for X (c3 before c5): a ring. The wait toward
    # the batch with the older oldest message (X for Y) is kept first, then Y's
    # for Z; Z's for X would close the ring, and is dropped: Z goes.
    locks, (x, y, z) = waiting((3, {C: 3, A: 4}), (1, {A: 1, B: 6}), (2, {B: 2, C: 5}))
    assert [locks._waits_for_another(tx) for tx in (x, y, z)] == [True, True, False]


def test_a_batch_waits_for_one_with_an_older_message_of_their_saga_whatever_else_it_holds() -> None:
    # A left x1 and k5 for later, B left k3: nothing is crossed, and B's k3 goes
    # before A's k5, though A's oldest message (x1) is older than any of B's.
    locks, (a, b) = waiting((1, {C: 1, A: 5}), (3, {A: 3}))
    assert locks._waits_for_another(a)
    assert not locks._waits_for_another(b)


def test_a_batch_waits_for_an_older_one_only_for_a_saga_where_that_one_is_older() -> None:
    # W left a2 for later; N, claimed after it, left a5 for later but ran an older
    # message c1: for saga "a", W goes first.
    locks, (w, n) = waiting((2, {A: 2}), (5, {A: 5}))
    assert locks._waits_for_another(n)
    assert not locks._waits_for_another(w)
