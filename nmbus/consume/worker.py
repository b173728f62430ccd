"""The worker: claim a batch, handle it in one transaction, record the outcomes.

Where a message is at every step:

1. ``claim``: one committed UPDATE takes up to ``batch_size`` ready rows with
   ``FOR UPDATE SKIP LOCKED``, counts the attempt (``retry_count + 1``) and
   leases them to this claim alone (:mod:`nmbus.consume.claim`: a token of its own in
   ``handling_client_id``, and ``lease_expires``). A process that dies simply
   lets the lease run out; the attempt stays counted (what happens next is
   :mod:`nmbus.consume.isolation`'s).
2. One transaction on the loop's own connection handles the batch: the
   :class:`~nmbus.consume.dispatch.Dispatcher` runs each message's handlers. A handler
   that touches ``ctx.connection`` gets a savepoint (lazily), so its failure
   undoes only its own writes; what handlers send is buffered. The transaction
   itself begins only with the first such write: a batch of handlers that
   write nothing costs no BEGIN and no COMMIT round trip. The registry's batch
   saga locks are taken first (an endpoint with sagas locks the batch's sagas,
   in one order). A batch that loses a deadlock outside its handlers is rolled
   back and run again under the same claim: no attempt is spent.
3. The buffered messages are inserted and the outcomes (X, R with
   ``retry_time``, F with ``error_info``) are written by one statement, which
   also claims the next batch; then one COMMIT (or, with no transaction, the
   finish commits by itself). A row changes only if its claim still holds
   its lease. A batch whose handlers take long does this in parts: at least
   every ``batch_commit_interval`` seconds what is done so far (outcomes,
   sends, replies) is committed between two handlers, and the rest of the
   batch goes on in a new transaction, still leased: a reply or a send never
   waits for the whole batch.

The Worker is built from its collaborators alone (store, dispatcher, settings,
client id) and owns its loops, their live claims (:class:`~nmbus.consume.claim.Claims`)
and their side tasks (lease renewal, wake-ups), each supervised
(:mod:`nmbus.maintenance.supervise`); a claimed batch is handled by its
:class:`~nmbus.consume.batch.BatchRunner` (steps 2 and 3).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import TYPE_CHECKING

import structlog

from nmbus.consume.batch import BatchRunner
from nmbus.consume.claim import Claim, Claims
from nmbus.consume.dispatch import Dispatcher
from nmbus.consume.dispatch.marks import StartMarks
from nmbus.consume.isolation import Gate, isolate, process_gate
from nmbus.consume.sizing import BatchSizer
from nmbus.consume.turns import Turn
from nmbus.consume.wakeups import Wakeups
from nmbus.delivery.flow import FlowLimits
from nmbus.errors import (
    ConfigurationError,
    DatabaseUnavailable,
    StoreError,
    cancelled_by_server,
)
from nmbus.logs import log_failure, per_message_logs
from nmbus.maintenance.supervise import Backoff, Services, supervise
from nmbus.ports.store import Store, WorkerSession
from nmbus.sagas.locks import SagaLocks
from nmbus.settings import Settings

if TYPE_CHECKING:
    from nmbus.telemetry.metrics import WorkerMetrics

log = structlog.get_logger("nmbus.worker")

#: How often a worker with flow limits and metrics counts what its limits hold
#: back (one statement that counts the ready rows of its limited types).
HELD_BACK_INTERVAL = 5.0
#: Seconds a batch's transaction may stay idle beyond its handlers' timeouts and
#: one part's commit interval (a busy event loop, the round trips between them).
IDLE_MARGIN = 5.0
#: Times one message's batch may be cut short by the server in this process (its
#: connection ended, a statement of nmbus's cancelled) at no cost to its attempts;
#: beyond, the attempt counts, so a message whose handler ends its own backend
#: every time still reaches F (as MAX_FREE_CONFLICTS does for conflicts).
MAX_FREE_INTERRUPTIONS = 10


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
        self._releases = SequenceReleases(settings.poll_interval)
        self._tasks: list[asyncio.Task[None]] = []
        self._side = Services(log, settings.reconnect_max_delay, f"nmbus-{queue}", queue=queue)
        # The claims of this worker's loops that have not ended yet.
        self.claims = Claims(client_id, settings.lease_seconds)
        self.batches = BatchRunner(
            queue=queue,
            store=store,
            dispatcher=dispatcher,
            settings=settings,
            claims=self.claims,
            dead_letter=self.dead_letter,
            metrics=metrics,
            stopping=self._stopping,
        )
        self._gate: Gate | None = None
        # Batches cut short by the server so far, by message (MAX_FREE_INTERRUPTIONS).
        self._interrupted: dict[int, int] = {}
        # Per loop, the claim whose batch the server cut short, to run again first.
        self._resumed: dict[int, Claim] = {}
        # The limits of the endpoint's handlers (nmbus/delivery/flow.py), read when it starts.
        self.flow: FlowLimits | None = None
        self._marks: StartMarks | None = None

    @property
    def in_flight(self) -> set[int]:
        """Ids of the rows this worker's live claims hold (the lease renewer keeps them)."""
        return self.claims.in_flight()

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

    def tasks(self) -> list[tuple[str, asyncio.Task[None]]]:
        """Its loops (``loop-0`` ...) and side tasks by name, while it runs (what
        ``/healthz`` watches: nmbus/telemetry/health.py)."""
        loops = [(f"loop-{index}", task) for index, task in enumerate(list(self._tasks))]
        return [*loops, *self._side.named()]

    # -- life cycle -------------------------------------------------------------

    def start(self) -> None:
        """Start ``settings.concurrency`` loops, the lease renewer and the wake-up listener."""
        self._gate = process_gate()
        self.claims.begin()
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
            self._marks = StartMarks(self.store, self.queue)
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
        self.claims.begin()
        sizer = BatchSizer(self.settings.batch_size)
        try:
            async with self.store.worker_session(self.flow, self._idle()) as session:
                ahead: Claim | None = None
                while True:
                    claim = ahead or await self._claim(session, sizer.limit, "burst")
                    if claim is None:
                        if await session.release_sequences(self.queue):
                            continue
                        break
                    ahead = await self._run_gated(session, claim, sizer, "burst")
        finally:
            # Cut short (cancelled, or its session failed): nothing stays claimed.
            await asyncio.shield(self._let_go_of_all())
        if self._marks is not None:
            await self._marks.close()
        done = self.outcomes - before
        return {subqueue: done[subqueue] for subqueue in ("X", "R", "F")}

    def _idle(self) -> float:
        """The longest a batch's transaction may stay idle while its handlers run:
        one message's handlers (their timeouts), one part's commit interval, a margin."""
        settings = self.settings
        longest = self.dispatcher.registry.longest_handling(settings.handler_timeout)
        return longest + settings.batch_commit_interval + IDLE_MARGIN

    def _on_wakeup(self, queue: str) -> None:
        if queue == self.queue or queue == "*":
            self._wakeups.one()

    async def _claim(self, session: WorkerSession, limit: int, loop: int | str) -> Claim | None:
        """Claim up to ``limit`` ready rows under a new token; None when none is ready."""
        await self.batches.renew_lapsed()
        token = self.claims.token(loop)
        since = time.monotonic()
        rows = await session.claim(self.queue, limit, token, self.settings.lease_seconds)
        return self.claims.take(token, rows, since)

    async def _renew_leases(self) -> None:
        """Keep the leases of the live claims alive, every ``lease_seconds / 3``."""
        lease = self.settings.lease_seconds
        while True:
            await asyncio.sleep(lease / 3)
            ids, tokens = self.claims.leases()
            if not ids:
                continue
            sent = time.monotonic()
            try:
                renewed = await self.store.renew_leases(self.queue, ids, tokens, lease)
            except StoreError as exc:
                log.warning("lease_renewal_failed", queue=self.queue, error=str(exc))
                if self.metrics is not None:
                    self.metrics.lease_renewal_failed()
            else:
                self.claims.renewed(renewed, sent)
                if self.metrics is not None:
                    self.metrics.leases_renewed(len(renewed))

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
        self._resumed.clear()  # still live claims: let go of below
        if self._marks is not None:
            # Before the leases of abandoned messages end: their starts must count.
            await self._marks.close()
        # The claims of cancelled loops (a batch cut short, or claimed ahead and never
        # reached): what started keeps its attempt, the rest goes back without one.
        await self._let_go_of_all()

    async def _let_go_of_all(self) -> None:
        for claim in self.claims:
            await self._let_go(claim)

    async def _let_go(self, claim: Claim) -> None:
        """Free what ``claim`` still holds at once: what started keeps its attempt
        (a cancelled handler), the rest goes back without one; the claim ends."""
        open_ids = claim.open_ids()
        started = [i for i in open_ids if i in claim.started]
        unstarted = [i for i in open_ids if i not in claim.started]
        for ids, refund in ((started, False), (unstarted, True)):
            if not ids:
                continue
            try:
                suspects = claim.suspects() if refund else ()
                await self.store.abandon_leases(
                    self.queue, ids, claim.token, refund=refund, suspects=suspects
                )
            except StoreError as exc:
                log.warning("worker_abandon_failed", queue=self.queue, ids=len(ids), error=str(exc))
        self.claims.end(claim)

    # -- the loop -----------------------------------------------------------------

    async def _loop(self, index: int) -> None:
        """One loop: a session on its own connection, opened again after each failure."""
        # Every log line of this loop's task (handlers' included) names the queue.
        structlog.contextvars.bind_contextvars(queue=self.queue)
        reconnect = self.settings.reconnect_max_delay
        backoff = Backoff(reconnect)

        async def connected() -> None:
            async with self.store.worker_session(self.flow, self._idle()) as session:
                await self._serve(session, index, backoff)

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
            elif cancelled_by_server(exc):
                log.warning(
                    "worker_statement_cancelled",
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

    async def _serve(self, session: WorkerSession, loop: int, backoff: Backoff) -> None:
        settings = self.settings
        # The next batch, claimed by the statement that finished the previous one (or
        # one the server cut short in the loop's last session: _run_again).
        ahead: Claim | None = self._resumed.pop(loop, None)
        releases = self._releases
        # Whether this loop was woken by a hint (a NOTIFY), not by its poll timeout,
        # or has just been busy.
        hinted = True
        sizer = BatchSizer(settings.batch_size)
        # Whether this loop holds the turn (nmbus/consume/turns.py).
        turn = False
        try:
            while ahead or not self._stopping.is_set():
                if releases.periodic():
                    # A sequence head a race left parked is released within a poll interval.
                    await session.release_sequences(self.queue)
                self._wakeups.claiming()
                if turn:
                    turn = self._turn.keep()
                elif ahead is None:  # claimed by the last finish: its rows wait for no turn
                    turn = await self._turn.take()
                if self._stopping.is_set() and ahead is None:
                    continue  # stopped while it waited for its turn: claims nothing
                if ahead is not None:
                    claim: Claim | None = ahead
                    ahead = None
                else:
                    claiming = time.monotonic()
                    claim = await self._claim(session, sizer.limit, loop)
                    if backoff.failures:
                        # Back once its session claims (not when it connects: a server
                        # that takes the connection and then ends it, or cancels the
                        # claim, keeps the pauses growing, one line each).
                        log.info("worker_reconnected", queue=self.queue, loop=loop)
                        backoff.reset()
                if claim is not None:
                    hinted = True  # busy until now: as if woken, when it next finds nothing
                    if len(claim.rows) >= sizer.limit:
                        self._wakeups.one()  # a full claim: more may be waiting
                    # Without the turn under contention, its finish claims nothing ahead.
                    sizes = sizer if turn or not self._contended() else None
                    ahead = await self._run_gated(session, claim, sizes, loop)
                    continue
                if turn:
                    self._turn.give()
                    turn = False
                # Woken by a send that found its sequence's head just finished (a race
                # that parks the new member), a loop claims nothing: release at once.
                idle = hinted and releases.idle(claiming)
                if idle and await session.release_sequences(self.queue):
                    continue
                wait = settings.poll_interval
                due = await session.next_due(self.queue)
                if due is not None:
                    wait = max(0.0, min(wait, due))
                limited = session.recheck is not None  # limited messages wait for room
                if limited:
                    wait = min(wait, session.recheck or 0.0)
                began = time.monotonic()
                hinted = await self._wakeups.wait(wait) if wait > 0 else True
                if limited and self.metrics is not None:
                    self.metrics.flow_waited(time.monotonic() - began)
        except BaseException as exc:
            # Claimed by the last finish, never begun: given back, unless the worker's
            # stop cancelled the loop (it lets go of every claim left).
            stopped = isinstance(exc, asyncio.CancelledError) and self._stopping.is_set()
            if ahead is not None and not stopped:
                # Cut short by the server, it runs in the next session, as a batch
                # cut short does (giving it back needs a statement the server may
                # not take yet: its rows would come back a lease later as suspects).
                cut = isinstance(exc, DatabaseUnavailable) or cancelled_by_server(exc)
                if not (cut and self._run_again(ahead, loop)):
                    await asyncio.shield(self._give_back(ahead))
            raise
        finally:
            if turn:
                self._turn.give()

    async def _give_back(self, claim: Claim) -> None:
        """A claim that will not run (its session failed before it began). Its fresh
        rows go back to I at once, their attempt not counted, unless claimed again
        since (their lease ran out: the other claim has them); a crash's suspects, and
        all when that fails, are left to run out and come back as a crash leaves them."""
        fresh = [
            m
            for m in claim.rows
            if not m.recovered and m.id not in claim.started and m.id not in claim.committed
        ]
        try:
            if fresh:
                ids, attempts = [m.id for m in fresh], [m.retry_count for m in fresh]
                await self.store.give_back(self.queue, ids, attempts, claim.token)
        except StoreError as exc:
            log.warning("worker_abandon_failed", queue=self.queue, ids=len(fresh), error=str(exc))
        self.claims.end(claim)

    def _run_again(self, claim: Claim, loop: int | str) -> bool:
        """The server cut ``claim``'s batch short (its connection ended, or it cancelled
        a statement of nmbus's): everything uncommitted was rolled back. Its rows run
        again under the same claim, still leased (and renewed), as the loop's first
        batch once it is connected again: no statement, so a server that cannot take
        one yet loses nothing, and no attempt, as for a conflict. Past
        MAX_FREE_INTERRUPTIONS for a message, or for a crash's suspect, a started row is
        left to its lease instead, its attempt counted, as a crash leaves it. False
        when nothing runs again (a burst has no later session: it lets go of all)."""
        if not isinstance(loop, int):
            return False
        again = [
            m
            for m in claim.rows
            if not m.recovered
            and m.id not in claim.committed
            and (m.id not in claim.started or self._free_interruption(m.id))
        ]
        if not again:
            return False
        claim.run_again(again)
        self._resumed[loop] = claim
        return True

    def _free_interruption(self, id: int) -> bool:
        """Whether message ``id``'s batch, cut short by the server, may cost it no attempt."""
        if len(self._interrupted) >= 10_000 and id not in self._interrupted:
            self._interrupted.clear()  # bounded: forgetting only makes more of them free
        cut = self._interrupted[id] = self._interrupted.get(id, 0) + 1
        return cut <= MAX_FREE_INTERRUPTIONS

    def _contended(self) -> bool:
        """Whether other processes' batches hold what this endpoint's batches need."""
        sagas = SagaLocks.found(self.dispatcher.registry)
        return sagas is not None and sagas.contended()

    async def _run_gated(
        self, session: WorkerSession, claim: Claim, sizer: BatchSizer | None, loop: int | str
    ) -> Claim | None:
        """Handle ``claim`` beside the process's other batches, or alone after a crash.

        The claim ends here, however its batch ends, but for a loop the worker's
        stop cancelled: the stop lets go of what it holds. Its lease is renewed
        while it lives, waiting at the gate included.
        """
        gate = self._gate or process_gate()
        try:
            if any(m.recovered for m in claim.rows):
                suspect = await isolate(session, self.queue, claim.rows, claim.token)
                if per_message_logs():
                    log.warning(
                        "message_isolated",
                        queue=self.queue,
                        message_id=suspect.id,
                        attempts=suspect.retry_count,
                        released=len(claim.rows) - 1,
                    )
                claim.narrow([suspect])
                async with gate.alone():
                    ahead = await self.batches.process(session, claim, sizer, loop)
            else:
                await gate.enter()
                try:
                    ahead = await self.batches.process(session, claim, sizer, loop)
                finally:
                    gate.leave()
        except asyncio.CancelledError:
            # The worker's stop lets go of every claim left; cancelled otherwise (a
            # handler that cancelled its own task), the loop ends: let go of it now.
            if not self._stopping.is_set():
                await asyncio.shield(self._let_go(claim))
            raise
        except BaseException as exc:
            cut = isinstance(exc, DatabaseUnavailable) or cancelled_by_server(exc)
            if cut and self._run_again(claim, loop):
                raise
            # Its session failed (a batch that failed otherwise has recorded every
            # outcome): what never started goes back at once, on the leases' own
            # connection; what started is left to run out, as a crash leaves it.
            await asyncio.shield(self._give_back(claim))
            raise
        self.claims.end(claim)
        return ahead


class SequenceReleases:
    """When the loops release parked sequence heads: once for the process, not per loop.

    The statement walks every sequence key that has a member outside X (a loose
    index scan: about 1 ms at 100 such keys, 10 ms at 1,000, 125 ms at 10,000),
    so each of a process's loops running it on its own multiplied that by the
    loops. Now it runs at most once per poll interval for the whole process (on
    the first loop to reach the top of its loop after that), and on an idle
    loop only if no loop began one since this loop began the claim that found
    nothing. It stays on the loops' own connections (docs/design.md says why).
    """

    __slots__ = ("interval", "last")

    def __init__(self, interval: float) -> None:
        self.interval = interval
        # When the last release began (monotonic).
        self.last = -float("inf")

    def periodic(self) -> bool:
        """Whether this loop releases now, a poll interval after the last release began."""
        now = time.monotonic()
        if now - self.last < self.interval:
            return False
        self.last = now
        return True

    def idle(self, claiming: float) -> bool:
        """Whether a loop whose claim (begun at ``claiming``) found nothing releases now."""
        if self.last >= claiming:
            return False  # begun since: it covers what that claim could not take
        self.last = time.monotonic()
        return True
