"""Whether a bus's process works: what ``/healthz`` and ``/readyz`` on its metrics port answer.

One :class:`Health` per Bus with ``metrics_port`` set owns what the probes
answer from (docs/operations.md, "Health probes"):

- **Liveness** (``/healthz``): every task the bus runs for as long as it runs
  (its worker loops ``loop-0`` ..., the worker's ``listener`` and ``leases``,
  the bus's ``subscriptions``, ``retention``, ``periodic``, ``forwarder`` when
  configured) is still running, and the event loop they share turns.

  * A task is read from its owner (the ``tasks`` callable) at each probe. Each
    is supervised (:mod:`nmbus.maintenance.supervise`): a failure restarts it,
    so one that was cancelled or ended with an exception while the bus runs
    has **stopped** for good (a handler that cancelled its own task ends its
    loop). One that returned by itself has finished its work (a subscription
    renewer with nothing that expires) and is not a failure.
  * The event loop beats: a timer on it writes the time every
    :data:`HEARTBEAT` seconds, the server's thread reads it. A beat older than
    :data:`BLOCKED_AFTER` seconds means the loop has not turned for that
    long: code holds it without awaiting (a handler that calls ``time.sleep``
    or computes for seconds), and every task of the process waits behind it.
    The loop is **blocked**, and the task holding it is named (read from the
    server's thread: ``asyncio.current_task(loop)``; a handler run beside
    others, ``handler_concurrency`` > 1, runs in a task named after its loop's).

- **Readiness** (``/readyz``): the process reaches its database through its
  own pool, the nmbus schema there is at the version this nmbus expects and
  the queue has its table (:meth:`nmbus.ports.store.Readiness.problem`). The
  check runs on the event loop, at most one at a time, and is given
  :data:`READY_TIMEOUT` seconds: no answer in time (a database that does not
  answer, or a blocked loop) is not ready.

While the bus starts and stops, liveness holds (its tasks start and end as
they should) and readiness does not. Nothing here logs: probes come every few
seconds, and their answers are their record.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from nmbus.errors import NmbusError
from nmbus.logs import scrub
from nmbus.ports.store import Readiness

#: Seconds between two beats of the event loop's timer.
HEARTBEAT = 0.5
#: A loop whose last beat is older than this many seconds is blocked.
BLOCKED_AFTER = 5.0
#: Seconds a readiness check may take before the process is not ready.
READY_TIMEOUT = 3.0

#: The tasks to watch, by the name a probe gives them: ``[("loop-0", task), ...]``.
TaskList = Callable[[], Iterable[tuple[str, "asyncio.Task[Any]"]]]
#: A probe's answer: whether it holds, and one line saying what was found.
Verdict = tuple[bool, str]


class Health:
    """The liveness and readiness of one bus's process, as its probes see them.

    ``tasks`` gives the tasks that must run while the bus does; ``check`` reads
    the database (the store's :meth:`~nmbus.ports.store.Store.readiness` of
    ``queue``). :meth:`start`, :meth:`running`, :meth:`stopping` and
    :meth:`stop` follow the bus's life cycle on its event loop; :meth:`live`
    and :meth:`ready` are asked from the server's threads.
    """

    def __init__(
        self,
        queue: str,
        schema: str,
        tasks: TaskList,
        check: Callable[[], Awaitable[Readiness]],
    ) -> None:
        self.queue = queue
        self.schema = schema
        self._tasks = tasks
        self._check = check
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._beat = 0.0
        # starting, running, stopping, stopped: the bus's life cycle as the probes see it.
        self.phase = "stopped"
        self._checking = threading.Lock()

    def __repr__(self) -> str:
        return f"<Health {self.queue!r} {self.phase}>"

    # -- the bus's life cycle (its event loop) --------------------------------------------

    def start(self) -> None:
        """The bus starts: the heartbeat begins on the running loop."""
        self._loop = asyncio.get_running_loop()
        self.phase = "starting"
        self._tick()

    def running(self) -> None:
        """The bus has started: its tasks are watched, readiness is checked."""
        self.phase = "running"

    def stopping(self) -> None:
        """The bus stops: its tasks end as they should, and it takes no more work."""
        if self.phase != "stopped":
            self.phase = "stopping"

    def stop(self) -> None:
        self.phase = "stopped"
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        assert self._loop is not None
        self._beat = time.monotonic()
        self._timer = self._loop.call_later(HEARTBEAT, self._tick)

    # -- the probes (the server's threads) ------------------------------------------------

    def live(self) -> Verdict:
        """``/healthz``: whether every task runs and the event loop turns."""
        named = list(self._tasks())
        loop = self._loop
        silent = time.monotonic() - self._beat
        if loop is not None and self.phase != "stopped" and silent > BLOCKED_AFTER:
            holder = self._holder(loop, named)
            base = holder.split(" (", 1)[0]
            waiting = [name for name, task in named if name != base and not task.done()]
            behind = f" ({', '.join(waiting)} wait behind it)" if waiting else ""
            return False, (
                f"blocked: {holder} has held the event loop for {silent:.1f} s "
                f"without awaiting{behind}"
            )
        if self.phase != "running":
            return True, f"ok: {self.phase}"
        stopped = [f"{name} ({_ending(task)})" for name, task in named if _stopped(task)]
        if stopped:
            return False, f"stopped: {', '.join(stopped)}"
        if not named:
            return True, "ok: no task to watch (a bus without workers)"
        running = [name for name, task in named if not task.done()]
        finished = [name for name, task in named if task.done()]
        done = f"; finished: {', '.join(finished)}" if finished else ""
        return True, f"ok: running {', '.join(running) or 'nothing'}{done}"

    def ready(self) -> Verdict:
        """``/readyz``: whether the process reaches its database, as it expects it."""
        loop = self._loop
        if loop is None or self.phase != "running":
            return False, f"not ready: {self.phase}"
        if not self._checking.acquire(timeout=READY_TIMEOUT):
            return False, f"not ready: the check under way has no answer after {READY_TIMEOUT:g} s"
        try:
            try:
                future = asyncio.run_coroutine_threadsafe(self._ask(), loop)
            except RuntimeError:  # the loop closed since: the bus has stopped
                return False, "not ready: stopped"
            try:
                return future.result(timeout=READY_TIMEOUT)
            except concurrent.futures.TimeoutError:
                future.cancel()
                return False, (
                    f"not ready: no answer within {READY_TIMEOUT:g} s "
                    "(the database does not answer, or the event loop is blocked: see /healthz)"
                )
            except concurrent.futures.CancelledError:
                return False, "not ready: the check was cancelled (the bus stops)"
        finally:
            self._checking.release()

    async def _ask(self) -> Verdict:
        try:
            found = await self._check()
        except NmbusError as exc:
            return False, f"not ready: {_line(str(exc) or type(exc).__name__)}"
        except Exception as exc:
            return False, f"not ready: {type(exc).__name__}: {_line(str(exc))}"
        problem = found.problem(self.schema, self.queue)
        if problem is not None:
            return False, f"not ready: {problem}"
        return True, (
            f"ready: schema {self.schema!r} at version {found.schema_version}, queue {self.queue!r}"
        )

    def _holder(self, loop: asyncio.AbstractEventLoop, named: list[tuple[str, Any]]) -> str:
        """The name of the task the blocked ``loop`` is running, as a probe calls it."""
        task = asyncio.current_task(loop)
        if task is None:
            return "code outside any task"
        for name, mine in named:
            if task is mine:
                return name
        own = task.get_name()
        for name, mine in named:
            parent, _, part = own.partition("/")
            if part and parent == mine.get_name():
                return f"{name} ({part})"
        return f"task {own!r}"


def _stopped(task: asyncio.Task[Any]) -> bool:
    return task.done() and (task.cancelled() or task.exception() is not None)


def _ending(task: asyncio.Task[Any]) -> str:
    if task.cancelled():
        return "cancelled"
    exc = task.exception()
    return "finished" if exc is None else f"ended by {type(exc).__name__}"


def _line(text: str) -> str:
    return scrub(" ".join(part.strip() for part in text.splitlines() if part.strip()))
