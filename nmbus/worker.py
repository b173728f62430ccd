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
client id) and owns its side tasks: the loops, lease renewal and wake-ups.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

import structlog

from nmbus.context import Effects
from nmbus.dispatch import (
    Dispatcher,
    Replay,
    because,
    cancelled_from_outside,
    debug_enabled,
    describe,
    per_message_logs,
)
from nmbus.envelopes import IN_REPLY_TO_HEADER, chain_of, dead_letter_copy, decode_type
from nmbus.errors import DatabaseUnavailable, LeaseLost, OutcomeNotRecorded, StoreError
from nmbus.logs import log_failure
from nmbus.messages import Envelope, StoredMessage
from nmbus.recovery import Gate, is_conflict, isolate, process_gate
from nmbus.settings import Settings
from nmbus.store import Batch, Outcomes, Store, WorkerSession
from nmbus.supervise import supervise

if TYPE_CHECKING:
    from nmbus.metrics import WorkerMetrics

log = structlog.get_logger("nmbus.worker")

#: Times a batch that lost a deadlock outside its handlers is run again at once.
MAX_CONFLICT_RETRIES = 5


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
        self._wakeup = asyncio.Event()
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._side: list[asyncio.Task[None]] = []
        self.in_flight: set[int] = set()
        # Rows a cancelled loop still holds: started (attempt counted) or not.
        self._abandoned: set[int] = set()
        self._unstarted: set[int] = set()
        self.handled = 0
        # Batches rolled back and run again with savepoints (handlers without
        # outside effects that failed after writing).
        self.replays = 0
        # Outcomes committed so far, by subqueue (X, R, F; "released" when given back).
        self.outcomes: Counter[str] = Counter()
        self._gate: Gate | None = None

    # -- life cycle -------------------------------------------------------------

    def start(self) -> None:
        """Start ``settings.concurrency`` loops, the lease renewer and the wake-up listener."""
        self._gate = process_gate()
        for index in range(self.settings.concurrency):
            task = asyncio.create_task(self._loop(index), name=f"nmbus-worker-{self.queue}-{index}")
            self._tasks.append(task)
        reconnect = self.settings.reconnect_max_delay
        for name, run in (
            ("listener", lambda: self.store.listen(self._on_wakeup, reconnect)),
            ("leases", self._renew_leases),
        ):
            side = supervise(run, name, log, reconnect, queue=self.queue)
            self._side.append(asyncio.create_task(side, name=f"nmbus-{self.queue}-{name}"))

    def wake(self) -> None:
        self._wakeup.set()

    async def run_burst(self) -> dict[str, int]:
        """Handle what is ready now, until nothing is, and return what became of it.

        Counts of committed outcomes by subqueue (``X``, ``R``, ``F``). No loop,
        listener or lease renewer is started: a burst is one connection working
        through the queue and returning, for scripts, cron jobs and tests (a
        handler that runs longer than ``lease_seconds`` may lose its message to
        another worker, as nothing renews its lease).
        """
        before = Counter(self.outcomes)
        async with self.store.worker_session() as session:
            ahead: list[StoredMessage] = []
            while True:
                batch = ahead or await session.claim(
                    self.queue,
                    self.settings.batch_size,
                    self.client_id,
                    self.settings.lease_seconds,
                )
                if not batch:
                    if await session.release_sequences(self.queue):
                        continue
                    break
                ahead = await self._run_gated(session, batch)
        done = self.outcomes - before
        return {subqueue: done[subqueue] for subqueue in ("X", "R", "F")}

    def _on_wakeup(self, queue: str) -> None:
        if queue == self.queue or queue == "*":
            self._wakeup.set()

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

    async def stop(self) -> None:
        """Finish in-flight handlers (up to ``shutdown_timeout``), return the rest to I."""
        self._stopping.set()
        self._wakeup.set()
        try:
            await self._stop_loops()
        finally:
            for task in self._side:
                task.cancel()
            await asyncio.gather(*self._side, return_exceptions=True)
            self._side.clear()

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
        # A batch claimed ahead that a cancelled loop never reached never started either.
        self._unstarted |= self.in_flight - self._abandoned
        for ids, refund in ((self._abandoned, False), (self._unstarted, True)):
            if not ids:
                continue
            try:
                await self.store.abandon_leases(
                    self.queue, sorted(ids), self.client_id, refund=refund
                )
            except StoreError as exc:
                log.warning("worker_abandon_failed", queue=self.queue, ids=len(ids), error=str(exc))
        self._abandoned, self._unstarted = set(), set()

    # -- the loop -----------------------------------------------------------------

    async def _loop(self, index: int) -> None:
        # Every log line of this loop's task (handlers' included) names the queue.
        structlog.contextvars.bind_contextvars(queue=self.queue)
        backoff = 0.1
        while not self._stopping.is_set():
            try:
                async with self.store.worker_session() as session:
                    if backoff > 0.1:
                        log.info("worker_reconnected", queue=self.queue, loop=index)
                    backoff = 0.1
                    await self._serve(session)
            except asyncio.CancelledError:
                if cancelled_from_outside():
                    raise
                log.error("worker_error", queue=self.queue, loop=index, error="CancelledError")
            except DatabaseUnavailable as exc:
                log.warning(
                    "worker_connection_lost",
                    queue=self.queue,
                    loop=index,
                    error=str(exc),
                    retry_in=backoff,
                )
            except Exception as exc:
                log_failure(log, "worker_error", exc, queue=self.queue, loop=index)
            if self._stopping.is_set():
                break
            await self._pause(backoff)
            backoff = min(self.settings.reconnect_max_delay, backoff * 2)

    async def _pause(self, seconds: float) -> None:
        try:
            async with asyncio.timeout(seconds):
                await self._stopping.wait()
        except TimeoutError:
            pass

    async def _serve(self, session: WorkerSession) -> None:
        settings = self.settings
        # The next batch, claimed by the statement that finished the previous one.
        ahead: list[StoredMessage] = []
        released = time.monotonic()
        while ahead or not self._stopping.is_set():
            if time.monotonic() - released >= settings.poll_interval:
                # A sequence head a race left parked is released within a poll interval.
                released = time.monotonic()
                await session.release_sequences(self.queue)
            self._wakeup.clear()
            if ahead:
                batch, ahead = ahead, []
            else:
                batch = await session.claim(
                    self.queue, settings.batch_size, self.client_id, settings.lease_seconds
                )
            if batch:
                ahead = await self._run_gated(session, batch)
                continue
            if await session.release_sequences(self.queue):
                released = time.monotonic()
                continue
            wait = settings.poll_interval
            due = await session.next_due(self.queue)
            if due is not None:
                wait = max(0.0, min(wait, due))
            if wait > 0 and not self._wakeup.is_set():
                try:
                    async with asyncio.timeout(wait):
                        await self._wakeup.wait()
                except TimeoutError:
                    pass

    async def _run_gated(
        self, session: WorkerSession, batch: list[StoredMessage]
    ) -> list[StoredMessage]:
        """Handle ``batch`` beside the process's other batches, or alone after a crash."""
        gate = self._gate or process_gate()
        if any(m.recovered for m in batch):
            suspect = await isolate(session, self.queue, batch, self.client_id)
            if per_message_logs():
                log.warning(
                    "message_isolated",
                    queue=self.queue,
                    message_id=suspect.id,
                    attempts=suspect.retry_count,
                    released=len(batch) - 1,
                )
            # Held while it waits for the process to go quiet: keep its lease alive.
            self.in_flight.add(suspect.id)
            async with gate.alone():
                return await self._process(session, [suspect], claim_ahead=True)
        if gate.closed:
            self.in_flight.update(m.id for m in batch)
        await gate.enter()
        try:
            return await self._process(session, batch, claim_ahead=True)
        finally:
            gate.leave()

    # -- one batch ---------------------------------------------------------------

    async def _process(
        self, session: WorkerSession, batch: list[StoredMessage], claim_ahead: bool = False
    ) -> list[StoredMessage]:
        """Handle ``batch``; return the next batch when it was claimed along with the finish."""
        ids = [m.id for m in batch]
        self.in_flight.update(ids)
        started: set[int] = set()
        # Rows whose outcome a part of the batch already committed: never run again.
        committed: set[int] = set()
        try:
            return await self._run_batch(session, batch, claim_ahead, started, committed)
        except asyncio.CancelledError:
            self._abandoned.update(started - committed)
            self._unstarted.update(i for i in ids if i not in started)
            raise
        except DatabaseUnavailable:
            raise
        except LeaseLost as exc:
            # Another worker has some of these rows now; running them again here would
            # be a waste. The others, still ours and rolled back, go back at once (those
            # never started without their attempt), not as crash suspects a lease later.
            log.warning("lease_lost", queue=self.queue, batch=len(batch), error=str(exc))
            held = [i for i in ids if i not in committed]
            for group, refund in (
                ([i for i in held if i in started], False),
                ([i for i in held if i not in started], True),
            ):
                if group:
                    try:
                        await self.store.abandon_leases(
                            self.queue, group, self.client_id, refund=refund
                        )
                    except StoreError as again:
                        log.warning("worker_abandon_failed", queue=self.queue, error=str(again))
            return []
        except Exception as exc:
            rest = [m for m in batch if m.id not in committed] if committed else batch
            if len(rest) > 1:
                # One message may be spoiling the batch: try each alone, still
                # under the same claim, so one poison pill cannot fail the others.
                log.warning(
                    "batch_failed_splitting", queue=self.queue, size=len(rest), error=str(exc)
                )
                for message in rest:
                    await self._process(session, [message])
                return []
            if rest:
                log.error("batch_failed", queue=self.queue, message_id=rest[0].id, error=str(exc))
                await self._record_failure(session, rest[0], exc)
            return []
        finally:
            self.in_flight.difference_update(ids)

    async def _record_failure(
        self, session: WorkerSession, row: StoredMessage, exc: Exception
    ) -> None:
        """The message's outcome could not be committed: a failed attempt, with backoff.

        Its handler may have succeeded, but what it wrote was rolled back (a
        deferred constraint, a send the store refused...): the attempt failed.
        """
        outcomes = Outcomes()
        # A StoreError's text already names the driver error: "doing: Type: message".
        text = str(exc) if isinstance(exc, StoreError) else describe(exc)
        failure = because(OutcomeNotRecorded(text), exc)
        self.dispatcher.failed(row, failure, self.dispatcher.policy(row), outcomes)
        try:
            async with session.batch() as tx:
                if self.dead_letter is not None:
                    await self._copy_failed(tx, [row], outcomes)
                await tx.finish(self.queue, outcomes, self.client_id)
        except DatabaseUnavailable:
            raise
        except Exception as again:
            log.error("outcome_not_recorded", queue=self.queue, message_id=row.id, error=str(again))
            await self.store.abandon_leases(self.queue, [row.id], self.client_id)
            return
        self.handled += 1
        self.outcomes.update(sq or "released" for sq in outcomes.subqueue)
        if self.metrics is not None:
            self.metrics.committed([row], outcomes, whole_batch=False)

    async def _run_batch(
        self,
        session: WorkerSession,
        batch: list[StoredMessage],
        claim_ahead: bool,
        started: set[int],
        committed: set[int],
    ) -> list[StoredMessage]:
        # A batch whose handlers all declared no outside effects runs without
        # savepoints. When one of them fails after writing, the transaction is
        # rolled back and the batch runs again with savepoints, that failure
        # standing: nothing of the first run was visible, and no handler that
        # could have effects elsewhere ran in it.
        unguarded = self.settings.handler_concurrency == 1 and self._replayable(batch)
        failed: dict[int, BaseException] = {}
        conflicts = 0
        while True:
            try:
                return await self._run_batch_once(
                    session, batch, claim_ahead, started, committed, unguarded, failed
                )
            except Replay as replay:
                self.replays += 1
                unguarded = False
                if replay.error is not None:
                    failed[replay.row.id] = replay.error
                # Only the part not committed yet was rolled back.
                batch = [m for m in batch if m.id not in committed]
            except StoreError as exc:
                # A deadlock or serialization failure outside the handlers: the batch
                # was rolled back; run it again under the same claim (no attempt spent).
                if conflicts >= MAX_CONFLICT_RETRIES or not is_conflict(exc):
                    raise
                conflicts += 1
                await asyncio.sleep(random.uniform(0.01, 0.05) * conflicts)
                # Only the part not committed yet was rolled back.
                batch = [m for m in batch if m.id not in committed]

    def _replayable(self, batch: list[StoredMessage]) -> bool:
        registry = self.dispatcher.registry
        if not registry.all_replayable and not all(
            registry.replayable(decode_type(m.label, m.msg_headers)) for m in batch
        ):
            return False
        # A reply is handed to the request waiting for it as it is handled, which
        # a rolled-back run cannot take back: a batch with one keeps its savepoints.
        return not any(m.msg_headers and IN_REPLY_TO_HEADER in m.msg_headers for m in batch)

    async def _run_batch_once(
        self,
        session: WorkerSession,
        batch: list[StoredMessage],
        claim_ahead: bool,
        started: set[int],
        committed: set[int],
        unguarded: bool,
        failed: dict[int, BaseException],
    ) -> list[StoredMessage]:
        outcomes = Outcomes()
        done: list[Effects] = []
        debug = debug_enabled()
        self.dispatcher.start_batch()
        partial = False
        interval = self.settings.batch_commit_interval
        async with session.batch() as tx:
            for hook in self.dispatcher.registry.batch_hooks:
                await hook(tx, batch)
            if self.settings.handler_concurrency > 1 and len(batch) > 1:
                await self._handle_concurrently(
                    tx, batch, outcomes, done, debug, started, committed
                )
            else:
                # One clock read per message; a commit only once a part took long.
                due = time.monotonic() + interval
                last = batch[-1]
                for message in batch:
                    if failed and message.id in failed:
                        # Failed after writing in a run that was rolled back: not run
                        # again, and its attempt counts even when the worker is stopping.
                        started.add(message.id)
                        policy = self.dispatcher.policy(message)
                        with structlog.contextvars.bound_contextvars(
                            message_id=message.id, message_type=message.label
                        ):
                            self.dispatcher.failed(message, failed[message.id], policy, outcomes)
                        continue
                    if self._stopping.is_set():
                        # Never started: back to I at once; the attempt does not count.
                        outcomes.add(message.id, None, correction=-1)
                        continue
                    started.add(message.id)
                    await self.dispatcher.handle(
                        tx, message, outcomes, done, debug, None, unguarded
                    )
                    if time.monotonic() >= due and message is not last:
                        await self._commit_part(tx, batch, outcomes, done, committed)
                        due = time.monotonic() + interval
            if done:
                await self._flush(tx, done)
            if self.dead_letter is not None and not outcomes.all_processed:
                await self._copy_failed(tx, batch, outcomes)
            ahead: list[StoredMessage] = []
            # The next batch is claimed by the finish's own statement.
            if claim_ahead and not self._stopping.is_set():
                changed, ahead = await tx.finish_and_claim(
                    self.queue,
                    outcomes,
                    self.client_id,
                    self.settings.batch_size,
                    self.settings.lease_seconds,
                )
            else:
                changed = await tx.finish(self.queue, outcomes, self.client_id)
            if changed != len(outcomes) and not tx.begun:
                # Nothing was written and the finish is already committed: the rows we
                # still held are done, the others are another worker's now (which of
                # them is not known here, so the metrics count none of this batch).
                partial = True
                log.warning(
                    "lease_lost",
                    queue=self.queue,
                    messages=len(outcomes) - changed,
                    batch=len(outcomes),
                )
            elif changed != len(outcomes):
                raise LeaseLost(
                    f"{len(outcomes) - changed} of {len(outcomes)} messages were taken over by "
                    "another worker after their lease expired; rolling back this batch"
                )
        self.handled += len(outcomes)
        self.outcomes.update(sq or "released" for sq in outcomes.subqueue)
        if self.metrics is not None and not partial:
            # One batch, whatever the parts it was committed in.
            self.metrics.committed(batch, outcomes, size=len(committed) + len(outcomes))
        # Committed: ours, and in flight from now on (the lease renewer must see them).
        self.in_flight.update(m.id for m in ahead)
        return ahead

    async def _commit_part(
        self,
        tx: Batch,
        batch: list[StoredMessage],
        outcomes: Outcomes,
        done: list[Effects],
        committed: set[int],
    ) -> None:
        """Commit the outcomes and effects of the batch's handlers that are done so far.

        Between two handlers (no savepoint open): their sends are stored, their
        rows finished, and the transaction committed; the rest of the batch goes
        on in a new one, its rows still leased to this worker.
        """
        part = outcomes.take()
        effects = done[:]
        done.clear()
        if effects:
            await self._flush(tx, effects)
        if self.dead_letter is not None and not part.all_processed:
            await self._copy_failed(tx, batch, part)
        changed = await tx.finish(self.queue, part, self.client_id)
        lost = len(part) - changed
        if lost and tx.begun:
            raise LeaseLost(
                f"{lost} of {len(part)} messages were taken over by another worker after "
                "their lease expired; rolling back this part of the batch"
            )
        await tx.commit()
        committed.update(part.ids)
        self.in_flight.difference_update(part.ids)
        # Counted as soon as committed: the rest of the batch may still fail.
        self.handled += len(part)
        self.outcomes.update(sq or "released" for sq in part.subqueue)
        if lost:
            log.warning("lease_lost", queue=self.queue, messages=lost, batch=len(part))
        elif self.metrics is not None:
            self.metrics.committed(batch, part, whole_batch=False)
        hooks = self.dispatcher.registry.batch_hooks
        if hooks:
            # The commit let go of what the hooks took (the saga locks): the rest of
            # the batch takes its own again, all at once, holding nothing meanwhile.
            rest = [m for m in batch if m.id not in committed]
            for hook in hooks:
                await hook(tx, rest)

    async def _handle_concurrently(
        self,
        tx: Batch,
        batch: list[StoredMessage],
        outcomes: Outcomes,
        done: list[Effects],
        debug: bool,
        started: set[int],
        committed: set[int],
    ) -> None:
        """Up to ``handler_concurrency`` handlers of the batch at once, for I/O-bound work.

        The batch's one connection cannot run two statements at once, and a
        handler's savepoint must not interleave with another's: a handler holds
        the batch's connection lock from its first use of ``ctx.connection`` until
        its savepoint is released or rolled back. Handlers that never touch the
        connection never wait for it. Every ``batch_commit_interval`` seconds, what
        the finished handlers did is committed under the same lock (so between
        savepoints), while the others go on.
        """
        slots = asyncio.Semaphore(self.settings.handler_concurrency)
        lock = asyncio.Lock()
        interval = self.settings.batch_commit_interval
        running = len(batch)
        finished = asyncio.Event()

        async def one(message: StoredMessage) -> None:
            nonlocal running
            try:
                async with slots:
                    if committer.done():
                        return  # a part's commit failed: so does the rest of the batch
                    if self._stopping.is_set():
                        outcomes.add(message.id, None, correction=-1)
                        return
                    started.add(message.id)
                    await self.dispatcher.handle(tx, message, outcomes, done, debug, lock)
            finally:
                running -= 1
                if not running:
                    finished.set()

        async def commit_now_and_then() -> None:
            while not finished.is_set():
                try:
                    async with asyncio.timeout(interval):
                        await finished.wait()
                except TimeoutError:
                    pass
                if finished.is_set() or not len(outcomes):
                    continue
                async with lock:
                    await self._commit_part(tx, batch, outcomes, done, committed)

        committer = asyncio.create_task(commit_now_and_then())
        try:
            # A TaskGroup: if one fails outside its handler (a database error while
            # rolling back), the others are cancelled and the batch fails as a whole.
            async with asyncio.TaskGroup() as group:
                for message in batch:
                    group.create_task(one(message))
        except BaseException:
            # A commit under way is let finish, so what it committed is known.
            finished.set()
            await asyncio.gather(committer, return_exceptions=True)
            raise
        # A commit that failed (or found leases lost) fails the rest of the batch.
        await committer

    async def _copy_failed(self, tx: Batch, batch: list[StoredMessage], outcomes: Outcomes) -> None:
        """Store a copy of every row going to F in the failure port, in ``tx``."""
        assert self.dead_letter is not None
        rows = {m.id: m for m in batch}
        made = [
            dead_letter_copy(
                self.queue,
                m.id,
                m.unique_id,
                m.label,
                m.msg_text,
                m.msg_headers,
                m.correlation_id,
                outcomes.error_info[i],
            )
            for i, id in enumerate(outcomes.ids)
            if outcomes.subqueue[i] == "F" and (m := rows.get(id)) is not None
        ]
        # A failure port's copy that fails in turn stays in F here, uncopied.
        copies = [c for c in made if c is not None]
        if copies:
            await tx.insert(self.dead_letter, self.queue, copies)

    async def _flush(self, tx: Batch, done: list[Effects]) -> None:
        """Store what the batch's handlers sent and published, in the batch's transaction."""
        by_queue: dict[str, list[Envelope]] = defaultdict(list)
        published: list[Envelope] = []
        for effects in done:
            for queue, envelope in effects.sends:
                by_queue[queue].append(envelope)
            published.extend(effects.publishes)
        for queue, envelopes in by_queue.items():
            await tx.insert(queue, self.queue, envelopes)
        if published:
            copies = await tx.publish(self.queue, published, [chain_of(e) for e in published])
            if not copies:
                log.info("published_without_subscribers", queue=self.queue, messages=len(published))
