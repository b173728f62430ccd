"""The traceback stored in ``error_info`` starts at the handler, not in the dispatcher."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import asyncpg

from nmbus import Bus, Context
from nmbus.testing import drain
from tests.messages import Ping


async def test_a_stored_traceback_begins_at_the_handler_frame(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("billing", max_attempts=1)

    def lookup(n: int) -> int:
        return {1: 1}[n]

    @bus.handler
    async def charge(msg: Ping, ctx: Context) -> None:
        if msg.n == 1:
            raise RuntimeError("before any await")  # raised by the first step of the coroutine
        await asyncio.sleep(0.01)  # the rest runs through the dispatcher's trampoline
        if msg.n == 2:
            raise RuntimeError("after an await")
        try:
            lookup(msg.n)
        except KeyError as exc:
            raise ValueError("no such card") from exc

    async with bus:
        for n in (1, 2, 3):
            await bus.send(Ping(n=n), to="billing")
        await drain(bus)
    rows = await db.fetch("SELECT subqueue, error_info FROM nmbus.billing ORDER BY id")
    assert [r["subqueue"] for r in rows] == ["F", "F", "F"]
    for row, first_line in zip(
        rows,
        [
            "RuntimeError: before any await",
            "RuntimeError: after an await",
            "ValueError: no such card",
        ],
        strict=True,
    ):
        info: str = row["error_info"]
        assert info.splitlines()[0] == first_line, info
        assert "dispatch.py" not in info and "coro.send" not in info, info
        # Every traceback of the chain (the KeyError's too) starts in this file.
        tracebacks = info.split("Traceback (most recent call last):\n")[1:]
        assert tracebacks, info
        for trace in tracebacks:
            assert trace.startswith(f'  File "{__file__}"'), info
        assert "in charge" in info
    assert "in lookup" in rows[2]["error_info"]
    assert "The above exception was the direct cause" in rows[2]["error_info"]
