"""The worker: claim a batch, handle it in one transaction, record the outcomes.

Where a message is at every step:

1. ``claim``: one committed UPDATE takes up to ``batch_size`` ready rows with
   ``FOR UPDATE SKIP LOCKED``, counts the attempt (``retry_count + 1``) and
   leases them to this process (``handling_client_id``, ``lease_expires``).
   A process that dies simply lets the lease run out; the attempt stays counted
   (what happens next is :mod:`nmbus.recovery`'s).
2. One transaction on the loop's own connection handles the batch: the
   :class:`~nmbus.dispatch.Dispatcher` runs each message's handlers. A handler
   that touches ``ctx.connection`` gets a savepoint (lazily), so its failure
   undoes only its own writes; what handlers send is buffered. The transaction
   itself begins only with the first such write: a batch of handlers that
   write nothing costs no BEGIN and no COMMIT round trip. The registry's batch
   hooks run first (an endpoint with sagas locks the batch's sagas there, in
   one order). A batch that loses a deadlock outside its handlers is rolled
   back and run again under the same claim: no attempt is spent.
3. The buffered messages are inserted and the outcomes (X, R with
   ``retry_time``, F with ``error_info``) are written by one statement, which
   also claims the next batch; then one COMMIT (or, with no transaction, the
   finish commits by itself). A row changes only if this process still holds
   its lease. A batch whose handlers take long does this in parts: at least
   every ``batch_commit_interval`` seconds what is done so far (outcomes,
   sends, replies) is committed between two handlers, and the rest of the
   batch goes on in a new transaction, still leased: a reply or a send never
   waits for the whole batch.

The Worker is built from its collaborators alone (store, dispatcher, settings,
client id) and owns its loops and their side tasks (lease renewal, wake-ups),
each supervised (:mod:`nmbus.supervise`); a claimed batch is handled by its
:class:`~nmbus.batch.BatchRunner` (steps 2 and 3).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import TYPE_CHECKING

import structlog

from nmbus.batch import BatchRunner
from nmbus.dispatch import Dispatcher
from nmbus.dispatch.marks import StartMarks
from nmbus.errors import ConfigurationError, DatabaseUnavailable, StoreError
from nmbus.flow import FlowLimits
from nmbus.logs import log_failure, per_message_logs
from nmbus.messages import StoredMessage
from nmbus.recovery import Gate, isolate, process_gate
from nmbus.settings import Settings
from nmbus.sizing import BatchSizer
from nmbus.store import Store, WorkerSession
from nmbus.supervise import Backoff, Services, supervise
from nmbus.turns import Turn
from nmbus.wakeups import Wakeups

if TYPE_CHECKING:
    from nmbus.metrics import WorkerMetrics

log = structlog.get_logger("nmbus.worker")

#: How often a worker with flow limits and metrics counts what its limits hold
#: back (one statement that counts the ready rows of its limited types).
HELD_BACK_INTERVAL = 5.0


class Worker:
    """All worker loops of one endpoint on its own queue, and their side tasks."""

    def __init__(
        self,
        *,
        queue: str,
        store: Store,
        dispatcher: Dispatcher,
        settings: Settings,
        client_id: str,
        dead_letter: str | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.queue = queue
        self.metrics = metrics
        # The failure port: a copy of every row this worker moves to F goes there,
        # in the same transaction (never from the port's own queue: no loop).
        self.dead_letter = dead_letter if dead_letter != queue else None
        self.store = store
        self.dispatcher = dispatcher
        self.settings = settings
        self.client_id = client_id
        self._wakeups = Wakeups()
        self._stopping = asyncio.Event()
        # The loops' turn to claim and run a batch under contention.
        self._turn = Turn(self._contended)
        self._tasks: list[asyncio.Task[None]] = []
        self._side = Services(log, settings.reconnect_max_delay, f"nmbus-{queue}", queue=queue)
        self.batches = BatchRunner(
            queue=queue,
            store=store,
            dispatcher=dispatcher,
            settings=settings,
            client_id=client_id,
            dead_letter=self.dead_letter,
            metrics=metrics,
            stopping=self._stopping,
        )
        self._gate: Gate | None = None
        # The limits of the endpoint's handlers (nmbus/flow.py), read when it starts.
        self.flow: FlowLimits | None = None
        self._marks: StartMarks | None = None

    @property
    def in_flight(self) -> set[int]:
        """Ids of the rows this worker holds now (the lease renewer keeps them leased)."""
        return self.batches.in_flight

    @property
    def handled(self) -> int:
        """Messages whose outcome this worker committed."""
        return self.batches.handled

    @property
    def replays(self) -> int:
        """Batches rolled back and run again with savepoints."""
        return self.batches.replays

    @property
    def outcomes(self) -> Counter[str]:
        """Committed outcomes by subqueue (X, R, F; "released" when given back)."""
        return self.batches.outcomes

    # -- life cycle -------------------------------------------------------------

    def start(self) -> None:
        """Start ``settings.concurrency`` loops, the lease renewer and the wake-up listener."""
        self._gate = process_gate()
        self.flow = self.dispatcher.registry.flow_limits(self.settings.handler_concurrency)
        if self.flow is not None and not getattr(self.store, "flow_limits", True):
            raise ConfigurationError(
                f"endpoint {self.queue!r} declares flow limits, which PostgreSQL's claim "
                "enforces; the in-memory store has none: test them on PostgreSQL"
            )
        self._mark_starts()
        for index in range(self.settings.concurrency):
            task = asyncio.create_task(self._loop(index), name=f"nmbus-worker-{self.queue}-{index}")
            self._tasks.append(task)
        reconnect = self.settings.reconnect_max_delay
        self._side.start("listener", lambda: self.store.listen(self._on_wakeup, reconnect))
        self._side.start("leases", self._renew_leases)
        if self.flow is not None and self.metrics is not None:
            self._side.start("held back", self._watch_held_back)

    async def declare_limits(self) -> None:
        """Record this endpoint's limits; warn when another process declared others.

        Each claim keeps to the limits of the process that runs it, so two
        processes of one endpoint with different limits each enforce their own
        (a deploy that changes a limit runs both for a while): said once, here.
        """
        if self.flow is None:
            return
        for key, limits, by, at in await self.store.declare_limits(
            self.queue, self.flow, self.client_id
        ):
            log.warning(
                "flow_limits_differ",
                queue=self.queue,
                handler=key,
                declared=self.flow.limits[key].describe(),
                other=limits,
                other_process=by,
                other_declared_at=at.isoformat(),
                note="each process's claims keep to its own limits",
            )

    def _mark_starts(self) -> None:
        """With a rate limit, mark in the store when each limited handler has started."""
        if self.flow is None or not self.flow.rated_keys:
            self.dispatcher.on_start = None
            return
        if self._marks is None:
            self._marks = StartMarks(self.store, self.queue, self.client_id)
        self.dispatcher.on_start = self._marks.started

    def wake(self) -> None:
        """Send one idle loop to claim now (as a notification of the queue does)."""
        self._wakeups.one()

    async def run_burst(self) -> dict[str, int]:
        """Handle what is ready now, until nothing is, and return what became of it.

        Counts of committed outcomes by subqueue (``X``, ``R``, ``F``). No loop,
        listener or lease renewer is started: a burst is one connection working
        through the queue and returning, for scripts, cron jobs and tests (a
        handler that runs longer than ``lease_seconds`` may lose its message to
        another worker, as nothing renews its lease).
        """
        before = Counter(self.outcomes)
        self.flow = self.dispatcher.registry.flow_limits(self.settings.handler_concurrency)
        self._mark_starts()
        sizer = BatchSizer(self.settings.batch_size)
        async with self.store.worker_session(self.flow, self._held()) as session:
            ahead: list[StoredMessage] = []
            while True:
                batch = ahead or await session.claim(
                    self.queue, sizer.limit, self.client_id, self.settings.lease_seconds
                )
                if not batch:
                    if await session.recover(self.queue):
                        continue
                    if await session.release_sequences(self.queue):
                        continue
                    break
                ahead = await self._run_gated(session, batch, sizer)
        if self._marks is not None:
            await self._marks.close()
        done = self.outcomes - before
        return {subqueue: done[subqueue] for subqueue in ("X", "R", "F")}

    def _on_wakeup(self, queue: str) -> None:
        if queue == self.queue or queue == "*":
            self._wakeups.one()

    async def _renew_leases(self) -> None:
        """Keep the leases of in-flight messages alive, every ``lease_seconds / 3``."""
        lease = self.settings.lease_seconds
        while True:
            await asyncio.sleep(lease / 3)
            ids = list(self.in_flight)
            if not ids:
                continue
            try:
                await self.store.renew_leases(self.queue, ids, self.client_id, lease)
            except StoreError as exc:
                log.warning("lease_renewal_failed", queue=self.queue, error=str(exc))
                if self.metrics is not None:
                    self.metrics.lease_renewal_failed()
            else:
                if self.metrics is not None:
                    self.metrics.leases_renewed(len(ids))

    async def _watch_held_back(self) -> None:
        """For the metrics: what each limit holds back, every HELD_BACK_INTERVAL s."""
        while True:
            try:
                found = await self.store.flow_status([self.queue])
            except StoreError as exc:
                log.warning("flow_status_failed", queue=self.queue, error=str(exc))
            else:
                if self.metrics is not None:
                    self.metrics.held_back({limit.handler: limit.held_back for limit in found})
            await asyncio.sleep(HELD_BACK_INTERVAL)

    async def stop(self) -> None:
        """Finish in-flight handlers (up to ``shutdown_timeout``), return the rest to I."""
        self._stopping.set()
        self._wakeups.every()
        try:
            await self._stop_loops()
        finally:
            await self._side.stop()

    async def _stop_loops(self) -> None:
        if not self._tasks:
            return
        _, pending = await asyncio.wait(self._tasks, timeout=self.settings.shutdown_timeout)
        if pending:
            log.warning(
                "worker_shutdown_timeout",
                queue=self.queue,
                timeout=self.settings.shutdown_timeout,
                loops=len(pending),
            )
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self._tasks.clear()
        if self._marks is not None:
            # Before the leases of abandoned messages end: their starts must count.
            await self._marks.close()
        # A batch claimed ahead that a cancelled loop never reached never started either.
        batches = self.batches
        batches.unstarted |= batches.in_flight - batches.abandoned
        for ids, refund in ((batches.abandoned, False), (batches.unstarted, True)):
            if not ids:
                continue
            try:
                await self.store.abandon_leases(
                    self.queue, sorted(ids), self.client_id, refund=refund
                )
            except StoreError as exc:
                log.warning("worker_abandon_failed", queue=self.queue, ids=len(ids), error=str(exc))
        batches.abandoned, batches.unstarted = set(), set()

    # -- the loop -----------------------------------------------------------------

    async def _loop(self, index: int) -> None:
        """One loop: a session on its own connection, opened again after each failure."""
        # Every log line of this loop's task (handlers' included) names the queue.
        structlog.contextvars.bind_contextvars(queue=self.queue)
        reconnect = self.settings.reconnect_max_delay
        backoff = Backoff(reconnect)

        async def connected() -> None:
            async with self.store.worker_session(self.flow, self._held()) as session:
                if backoff.failures:
                    log.info("worker_reconnected", queue=self.queue, loop=index)
                backoff.reset()
                await self._serve(session)

        def report(exc: BaseException, pause: float) -> None:
            if isinstance(exc, asyncio.CancelledError):
                log.error("worker_error", queue=self.queue, loop=index, error="CancelledError")
            elif isinstance(exc, DatabaseUnavailable):
                log.warning(
                    "worker_connection_lost",
                    queue=self.queue,
                    loop=index,
                    error=str(exc),
                    retry_in=round(pause, 3),
                )
            else:
                log_failure(log, "worker_error", exc, queue=self.queue, loop=index)

        await supervise(
            connected,
            f"loop-{index}",
            log,
            reconnect,
            restart=True,
            backoff=backoff,
            report=report,
            stop=self._stopping,
        )

    async def _serve(self, session: WorkerSession) -> None:
        settings = self.settings
        # The next batch, claimed by the statement that finished the previous one.
        ahead: list[StoredMessage] = []
        released = time.monotonic()
        sizer = BatchSizer(settings.batch_size)
        # Whether this loop holds the turn (nmbus/turns.py).
        turn = False
        try:
            while ahead or not self._stopping.is_set():
                if time.monotonic() - released >= settings.poll_interval:
                    # A sequence head a race left parked is released within a poll
                    # interval, and a held batch whose worker died is recovered.
                    released = time.monotonic()
                    await session.release_sequences(self.queue)
                    await session.recover(self.queue)
                self._wakeups.claiming()
                if turn:
                    turn = self._turn.keep()
                elif not ahead:  # claimed by the last finish: its rows wait for no turn
                    turn = await self._turn.take()
                if self._stopping.is_set() and not ahead:
                    continue  # stopped while it waited for its turn: claims nothing
                if ahead:
                    batch, ahead = ahead, []
                else:
                    batch = await session.claim(
                        self.queue, sizer.limit, self.client_id, settings.lease_seconds
                    )
                if batch:
                    if len(batch) >= sizer.limit:
                        self._wakeups.one()  # a full claim: more may be waiting
                    # Without the turn under contention, its finish claims nothing ahead.
                    claims = sizer if turn or not self._contended() else None
                    ahead = await self._run_gated(session, batch, claims)
                    continue
                if turn:
                    self._turn.give()
                    turn = False
                if await session.recover(self.queue) or await session.release_sequences(self.queue):
                    released = time.monotonic()
                    continue
                wait = settings.poll_interval
                due = await session.next_due(self.queue)
                if due is not None:
                    wait = max(0.0, min(wait, due))
                held = session.recheck is not None  # limited messages wait for room
                if held:
                    wait = min(wait, session.recheck or 0.0)
                began = time.monotonic()
                if wait > 0:
                    await self._wakeups.wait(wait)
                if held and self.metrics is not None:
                    self.metrics.flow_waited(time.monotonic() - began)
        except Exception:
            if ahead:  # claimed by the last finish, never begun: given back
                await self._give_back(ahead)
            raise
        finally:
            if turn:
                self._turn.give()

    async def _give_back(self, batch: list[StoredMessage]) -> None:
        """A claimed batch that will not run (its session failed before it began).
        Its fresh rows go back to I at once, their attempt not counted, unless claimed
        again since (their lease ran out: another loop may run them, renewed); a
        crash's suspects, and all when that fails, are left to run out and come back
        as a crash leaves them. The renewer lets go of all that is not another's."""
        fresh = [m for m in batch if not m.recovered]
        let_go = {m.id for m in batch}
        try:
            if fresh:
                ids, attempts = [m.id for m in fresh], [m.retry_count for m in fresh]
                given = await self.store.give_back(self.queue, ids, attempts, self.client_id)
                let_go -= set(ids) - set(given)
        except StoreError as exc:
            log.warning("worker_abandon_failed", queue=self.queue, ids=len(fresh), error=str(exc))
        self.in_flight.difference_update(let_go)

    def _contended(self) -> bool:
        """Whether other processes' batches hold what this endpoint's batches need."""
        return any(hook.contended() for hook in self.dispatcher.registry.batch_hooks)

    def _held(self) -> bool:
        """Whether this worker's batches are held (setting held_batches): not with flow
        limits (their claims lease, to count what is in flight) nor with handlers
        run concurrently (their part commits come while other handlers run)."""
        settings = self.settings
        return settings.held_batches and self.flow is None and settings.handler_concurrency == 1

    async def _run_gated(
        self, session: WorkerSession, batch: list[StoredMessage], sizer: BatchSizer | None
    ) -> list[StoredMessage]:
        """Handle ``batch`` beside the process's other batches, or alone after a crash."""
        gate = self._gate or process_gate()
        if any(m.recovered for m in batch):
            try:
                suspect = await isolate(session, self.queue, batch, self.client_id)
            except Exception:
                await self._give_back(batch)
                raise
            if per_message_logs():
                log.warning(
                    "message_isolated",
                    queue=self.queue,
                    message_id=suspect.id,
                    attempts=suspect.retry_count,
                    released=len(batch) - 1,
                )
            # Held while it waits for the process to go quiet: keep its lease alive.
            kept = [suspect.id]
            self.in_flight.update(kept)
            async with gate.alone():
                return await self._guarded(session, [suspect], sizer, kept)
        kept = []
        if gate.closed and not session.holding:
            # Waiting for the process to go quiet: keep the batch's leases alive (a
            # held batch's rows have none: its transaction keeps them).
            kept = [m.id for m in batch]
            self.in_flight.update(kept)
        await gate.enter()
        try:
            return await self._guarded(session, batch, sizer, kept)
        finally:
            gate.leave()

    async def _guarded(
        self,
        session: WorkerSession,
        batch: list[StoredMessage],
        sizer: BatchSizer | None,
        kept: list[int],
    ) -> list[StoredMessage]:
        """Run ``batch``; ``kept``: the leases kept alive while it waited at the gate."""
        try:
            return await session.guarded(self.batches.process(session, batch, ahead=sizer))
        except DatabaseUnavailable:
            # Its connection ended before it began (stopped_with): the leases kept
            # alive for it are left to run out, as a crash leaves them. (Begun, the
            # batch has taken its ids out already.)
            self.in_flight.difference_update(kept)
            raise
