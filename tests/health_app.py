"""A service run as `nmbus worker tests.health_app:make_bus` by tests/test_health.py.

Two loops. A ``probe.Quit`` ends the loop that handles it, once per process (its
handler cancels its own task, which no supervisor restarts); a ``probe.Hold``
holds the event loop with ``time.sleep``. Each handler prints the name of the
task it runs in, so the test knows which loop to expect in ``/healthz``. Its DSN
comes from NMBUS_DSN, its port from NMBUS_METRICS_PORT.
"""

from __future__ import annotations

import asyncio
import time

from nmbus import Bus, Context, Message


class Quit(Message, type_name="probe.Quit"):
    pass


class Hold(Message, type_name="probe.Hold"):
    seconds: float


_ended: list[str] = []


def make_bus() -> Bus:
    bus = Bus("probed", poll_interval=1.0, lease_seconds=60.0, concurrency=2)

    @bus.handler
    async def quit_loop(msg: Quit, ctx: Context) -> None:
        task = asyncio.current_task()
        assert task is not None
        if not _ended:
            _ended.append(task.get_name())
            print(f"ending {task.get_name()}", flush=True)
            task.cancel()
            await asyncio.sleep(0)

    @bus.handler
    async def hold_loop(msg: Hold, ctx: Context) -> None:
        task = asyncio.current_task()
        assert task is not None
        print(f"holding {task.get_name()}", flush=True)
        time.sleep(msg.seconds)  # blocks the event loop: the point of this handler

    return bus
