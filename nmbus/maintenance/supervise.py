"""Services that must not vanish: start one, restart it after failure, stop it.

A listener that died silently would leave a queue waiting for its slow poll,
a lease renewer that died would let running handlers' messages be taken over.
Every long-running task of nmbus runs under :func:`supervise`, the one place
that knows how to restart: the side tasks of a bus and of its worker (listener,
lease renewal, retention, subscription renewal, the periodic scheduler, the
forwarder), each worker loop, and the LISTEN loop's reconnections.

- A failure is logged (by default ``background_task_failed``, without frame
  locals: :func:`nmbus.logs.log_failure`) and the service started again after
  a pause from :class:`Backoff`: 0.1 s at first, doubled after each failure,
  never above the owner's cap (``reconnect_max_delay``), spread a little so
  that many processes that lost one server do not all come back at once.
- A service that returns on its own is done (a renewer with nothing left to
  renew), unless it is one whose return means "go again" (``restart=True``: a
  LISTEN session whose connection was lost), which is started again after the
  same pause.
- It stops when its owner cancels it, at once, even in a pause; or, given a
  ``stop`` event, when the event is set: a run that then ends is not started
  again, and a pause under way ends.

:class:`Services` holds an owner's side tasks: started by name, stopped together.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

from nmbus.logs import log_failure

#: The first pause after a failure, in seconds; and never shorter than this.
FIRST_PAUSE = 0.1
#: A service that ran this long before failing starts again with the first pause.
HEALTHY_SECONDS = 60.0
#: Each pause is drawn from the top fifth below its doubled value (never under
#: ``FIRST_PAUSE``): processes that lost one server reconnect spread apart.
SPREAD = 0.2

#: How a supervised service's failure is logged: ``report(exc, pause)``.
Report = Callable[[BaseException, float], None]


class Backoff:
    """The pauses between attempts: doubled after each failure up to ``cap``, with jitter.

    The n-th pause in a row (from 0) lies between ``max(first, 0.8 * d)`` and
    ``d``, where ``d = min(cap, first * 2**n)``: never shorter than ``first``,
    never longer than ``cap``. :meth:`reset` after a success starts over.
    """

    __slots__ = ("_base", "cap", "failures", "first")

    def __init__(self, cap: float, first: float = FIRST_PAUSE) -> None:
        self.cap = cap
        self.first = first
        # Failures since the last reset (0: the last attempt went well).
        self.failures = 0
        self._base = min(cap, first)

    def next(self) -> float:
        """The pause before the next attempt; the one after it will be longer (up to ``cap``)."""
        base = self._base
        self._base = min(self.cap, base * 2)
        self.failures += 1
        low = min(base, max(self.first, base * (1 - SPREAD)))
        return random.uniform(low, base)

    def reset(self) -> None:
        self.failures = 0
        self._base = min(self.cap, self.first)


async def supervise(
    run: Callable[[], Awaitable[None]],
    name: str,
    logger: Any,
    max_pause: float,
    *,
    restart: bool = False,
    backoff: Backoff | None = None,
    report: Report | None = None,
    stop: asyncio.Event | None = None,
    **fields: Any,
) -> None:
    """Run ``run()`` until it returns, starting it again after each failure.

    ``restart``: a return is also followed by a pause and a new start.
    ``backoff``: the pauses (default: a new :class:`Backoff` capped at
    ``max_pause``); a service that knows when it is healthy again (connected)
    resets it itself. ``report(exc, pause)`` logs a failure (default:
    ``background_task_failed`` with ``task=name``, ``restart_in`` and
    ``fields``). ``stop``: once set, nothing is started again. A cancellation
    of the caller's task stops at once; a ``CancelledError`` that is not one
    (a stray one from inside ``run``) is a failure like any other.
    """
    loop = asyncio.get_running_loop()
    pauses = backoff if backoff is not None else Backoff(max_pause)
    while stop is None or not stop.is_set():
        started = loop.time()
        failure: BaseException | None = None
        try:
            await run()
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            failure = exc
        except Exception as exc:
            failure = exc
        if failure is None and not restart:
            return  # finished on its own (nothing to do): not a failure
        if failure is not None and loop.time() - started > HEALTHY_SECONDS:
            pauses.reset()
        pause = pauses.next()
        if failure is not None:
            if report is not None:
                report(failure, pause)
            else:
                log_failure(
                    logger,
                    "background_task_failed",
                    failure,
                    task=name,
                    restart_in=round(pause, 3),
                    **fields,
                )
        if stop is not None and stop.is_set():
            return  # told to stop meanwhile: no pause, no new start
        await _sleep(pause, stop)


async def _sleep(seconds: float, stop: asyncio.Event | None) -> None:
    if stop is None:
        await asyncio.sleep(seconds)
        return
    try:
        async with asyncio.timeout(seconds):
            await stop.wait()
    except TimeoutError:
        pass


class Services:
    """The supervised side tasks of one owner (a bus, a worker): started by name, stopped together.

    Each runs under :func:`supervise` with the owner's logger, cap and log
    fields; ``task_prefix`` names the asyncio tasks (``{task_prefix}-{name}``).
    """

    def __init__(self, logger: Any, max_pause: float, task_prefix: str, **fields: Any) -> None:
        self.logger = logger
        self.max_pause = max_pause
        self.task_prefix = task_prefix
        self.fields = fields
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        """Run ``run`` as a side task, supervised: logged and restarted whenever it dies."""
        side = supervise(run, name, self.logger, self.max_pause, **self.fields)
        self.tasks.append(asyncio.create_task(side, name=f"{self.task_prefix}-{name}"))

    def named(self) -> list[tuple[str, asyncio.Task[None]]]:
        """Each side task with the name it was started under, while they run."""
        prefix = f"{self.task_prefix}-"
        return [(task.get_name().removeprefix(prefix), task) for task in list(self.tasks)]

    async def stop(self) -> None:
        """Cancel every side task and wait until each has ended."""
        tasks, self.tasks = self.tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
