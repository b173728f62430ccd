"""Wake-ups (nmbus/consume/wakeups.py): a notification sends one idle loop to claim, not all."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from nmbus import Bus, Context
from nmbus.consume.wakeups import Wakeups
from nmbus.postgres.session import PostgresSession
from tests.messages import Ping
from tests.waits import wait_until


async def test_a_hint_wakes_one_idle_loop_and_a_hint_with_none_idle_is_kept() -> None:
    wakeups = Wakeups()
    woken: list[int] = []

    async def loop(n: int) -> None:
        await wakeups.wait(5.0)
        woken.append(n)

    tasks = [asyncio.create_task(loop(n)) for n in range(3)]
    await asyncio.sleep(0.01)
    wakeups.one()
    await asyncio.sleep(0.01)
    assert woken == [0]  # the loop idle longest
    wakeups.every()
    await asyncio.gather(*tasks)
    assert sorted(woken) == [0, 1, 2]
    # every() is kept for the next loop to wait too: a stopping worker never sleeps.
    await asyncio.wait_for(wakeups.wait(5.0), 1.0)
    wakeups.one()  # no loop idle: kept
    await asyncio.wait_for(wakeups.wait(5.0), 1.0)
    wakeups.one()
    wakeups.claiming()  # the claim that follows serves it
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(wakeups.wait(5.0), 0.1)


async def test_a_timed_out_wait_leaves_no_waiter_behind() -> None:
    wakeups = Wakeups()
    for _ in range(5):
        await wakeups.wait(0.01)
    assert wakeups.idle == 0  # a queue that is never notified piles up nothing
    wakeups.one()  # nobody idle any more: kept, not spent on a dead waiter
    await asyncio.wait_for(wakeups.wait(5.0), 1.0)
    assert wakeups.idle == 0


async def test_messages_at_a_trickle_cost_four_loops_no_more_claims_than_one(
    make_bus: Callable[..., Bus], monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = 0
    claim = PostgresSession.claim

    async def counting(self: PostgresSession, *args: Any, **kwargs: Any) -> Any:
        nonlocal empty
        found = await claim(self, *args, **kwargs)
        empty += not found
        return found

    monkeypatch.setattr(PostgresSession, "claim", counting)

    async def claims_in_vain(loops: int) -> int:
        """Claims that found nothing while 20 messages arrive one at a time."""
        bus = make_bus("billing", concurrency=loops, poll_interval=30.0)
        handled: list[int] = []

        @bus.handler
        async def on_ping(msg: Ping, ctx: Context) -> None:
            handled.append(msg.n)

        async with bus:
            await wait_until(lambda: empty >= loops, timeout=10)  # each loop's first claim
            await asyncio.sleep(0.1)
            before = empty
            for n in range(20):
                await bus.send(Ping(n=n), to="billing")
                await wait_until(lambda n=n: len(handled) == n + 1, timeout=10)
            await asyncio.sleep(0.1)
            return empty - before

    one = await claims_in_vain(1)
    empty = 0
    four = await claims_in_vain(4)
    # Woken all at once, four loops claimed four times a message, three of them in vain.
    assert four <= one + 3, (one, four)
