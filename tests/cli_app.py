"""A service run as `nmbus worker tests.cli_app:bus` by tests/test_cli_worker.py.

Its DSN comes from NMBUS_DSN.
"""

from __future__ import annotations

import asyncio

from nmbus import Bus, Context
from tests.messages import Ping


def make_bus() -> Bus:
    bus = Bus("clitest", poll_interval=1.0, lease_seconds=10.0)

    @bus.handler
    async def on_ping(msg: Ping, ctx: Context) -> None:
        print(f"started {msg.n}", flush=True)
        await asyncio.sleep(2.0)
        print(f"finished {msg.n}", flush=True)

    return bus


bus = make_bus()
