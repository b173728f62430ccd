"""One claimed batch: handled in one transaction, its outcomes recorded.

Steps 2 and 3 of :mod:`nmbus.consume.worker`'s path: the :class:`BatchRunner` of a
worker takes the :class:`~nmbus.consume.claim.Claim` a loop claimed, runs the
saga locks and the handlers (one after another, or up to
``handler_concurrency`` at once), stores what they sent, writes the outcomes
with the statement that claims the next batch, and commits, in parts when the
handlers take long. What became of each message is the claim's own (its
``started`` and ``committed``); the runner keeps only the counts of committed
outcomes. A message whose claim's lease may have lapsed is not started: it goes
back unchanged, its attempt not counted, unless another claim has it already.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import TYPE_CHECKING

import structlog

from nmbus.consume.claim import Claim, Claims
from nmbus.consume.dispatch import (
    Dispatcher,
    Replay,
    Savepoints,
    SerialBatch,
    Unguarded,
    because,
    describe,
)
from nmbus.consume.isolation import is_conflict
from nmbus.consume.output import copy_failed, store_effects
from nmbus.consume.sizing import BatchSizer
from nmbus.context import Effects
from nmbus.envelopes import IN_REPLY_TO_HEADER
from nmbus.errors import (
    DatabaseUnavailable,
    LeaseLost,
    OutcomeNotRecorded,
    StoreError,
    cancelled_by_server,
)
from nmbus.logs import debug_enabled
from nmbus.messages import StoredMessage
from nmbus.ports.store import Batch, Outcomes, SagaTable, Store, WorkerSession
from nmbus.received import Received
from nmbus.sagas.locks import SagaLocks
from nmbus.settings import Settings

if TYPE_CHECKING:
    from nmbus.telemetry.metrics import WorkerMetrics

log = structlog.get_logger("nmbus.worker")

#: Times a batch that lost a deadlock outside its handlers is run again at once.
MAX_CONFLICT_RETRIES = 5


class BatchRunner:
    """Handles the claimed batches of one queue for a worker, and counts what became of them."""

    def __init__(
        self,
        *,
        queue: str,
        store: Store,
        dispatcher: Dispatcher,
        settings: Settings,
        claims: Claims,
        dead_letter: str | None,
        metrics: WorkerMetrics | None,
        stopping: asyncio.Event,
    ) -> None:
        self.queue = queue
        self.store = store
        self.dispatcher = dispatcher
        self.settings = settings
        # The worker's live claims: a claim taken ahead by a finish goes in at once.
        self.claims = claims
        self.dead_letter = dead_letter
        self.metrics = metrics
        # Set when the worker stops: handlers not started yet are not started.
        self._stopping = stopping
        self.handled = 0
        # Batches rolled back and run again with savepoints (handlers without
        # outside effects that failed after writing).
        self.replays = 0
        # Outcomes committed so far, by subqueue (X, R, F; "released" when given back).
        self.outcomes: Counter[str] = Counter()
        self._saga_table: SagaTable | None = None

    @property
    def saga_table(self) -> SagaTable:
        """The saga table of this queue in the store the batches run on."""
        if self._saga_table is None:
            self._saga_table = self.store.saga_table(self.queue)
        return self._saga_table

    async def process(
        self,
        session: WorkerSession,
        claim: Claim,
        ahead: BatchSizer | None = None,
        loop: int | str = 0,
    ) -> Claim | None:
        """Handle the rows of ``claim``; return the next claim when the finish took one.

        ``ahead``: the loop's claim size, told how long this batch took before the
        next is claimed with its finish (None: nothing is claimed ahead); ``loop``
        names the loop in the next claim's token. A cancelled batch leaves what its
        claim recorded (started, committed) for the worker's stop to let go of.
        Messages not started because the claim's lease may have lapsed are given
        back once the batch is done (if the claim still holds them), never with
        its outcomes: another claim may hold them, which is no lease lost.
        """
        following = await self._attempt(session, claim, claim.rows, ahead, loop)
        if claim.skipped:
            await self._give_back_skipped(claim)
        return following

    async def _give_back_skipped(self, claim: Claim) -> None:
        rows = [m for m in claim.skipped if m.id not in claim.started | claim.committed]
        claim.skipped = []
        if not rows:
            return
        try:
            given = await self.store.give_back(
                self.queue, [m.id for m in rows], [m.retry_count for m in rows], claim.token
            )
        except StoreError as exc:
            # Left to their lease, which runs out as a crash's would.
            log.warning("worker_abandon_failed", queue=self.queue, ids=len(rows), error=str(exc))
            return
        # No longer this claim's: the renewer lets go of them.
        claim.committed.update(m.id for m in rows)
        self.outcomes["released"] += len(given)

    async def _attempt(
        self,
        session: WorkerSession,
        claim: Claim,
        rows: list[StoredMessage],
        ahead: BatchSizer | None,
        loop: int | str,
    ) -> Claim | None:
        """Handle ``rows`` (all of ``claim``'s, or one of them after a split)."""
        try:
            return await self._run_batch(session, claim, rows, ahead, loop)
        except (asyncio.CancelledError, DatabaseUnavailable):
            raise
        except LeaseLost as exc:
            # Another claim has some of these rows now; running them again here would
            # be a waste. The others, still this claim's and rolled back, go back at
            # once (those never started without their attempt), not as crash suspects
            # a lease later. Only rows still leased by this claim change.
            log.warning("lease_lost", queue=self.queue, batch=len(rows), error=str(exc))
            held = [m.id for m in rows if m.id not in claim.committed]
            for group, refund in (
                ([i for i in held if i in claim.started], False),
                ([i for i in held if i not in claim.started], True),
            ):
                if group:
                    try:
                        suspects = claim.suspects() if refund else ()
                        await self.store.abandon_leases(
                            self.queue, group, claim.token, refund=refund, suspects=suspects
                        )
                    except StoreError as again:
                        log.warning("worker_abandon_failed", queue=self.queue, error=str(again))
            return None
        except Exception as exc:
            if cancelled_by_server(exc):
                # The server cancelled a statement of nmbus's (its statement_timeout):
                # nothing says a message is to blame. The session's failure, so the
                # loop backs off; the claim then runs again, no attempt spent
                # (nmbus/consume/worker.py, _run_again).
                raise
            rest = [m for m in rows if m.id not in claim.committed]
            if len(rest) > 1:
                # One message may be spoiling the batch: try each alone, still
                # under the same claim, so one poison pill cannot fail the others.
                log.warning(
                    "batch_failed_splitting", queue=self.queue, size=len(rest), error=str(exc)
                )
                for message in rest:
                    await self._attempt(session, claim, [message], None, loop)
                return None
            if rest:
                log.error("batch_failed", queue=self.queue, message_id=rest[0].id, error=str(exc))
                await self._record_failure(session, claim, rest[0], exc)
            return None

    async def renew_lapsed(self) -> None:
        """Before a claim: renew the leases of this worker's claims that lapsed by the clock.

        They lapse when the event loop was held past a lease (a handler that blocks
        it, a paused process): the renewer had no turn meanwhile, and a claim now
        would take the rows of the other loops' batches, still running, for a
        crash's, and run them again. Renewed first (as the renewer would have), the
        rows stay theirs; a row another process took since is not touched.
        """
        ids, tokens = self.claims.lapsed_leases()
        if not ids:
            return
        sent = time.monotonic()
        try:
            renewed = await self.store.renew_leases(
                self.queue, ids, tokens, self.settings.lease_seconds
            )
        except StoreError as exc:
            log.warning("lease_renewal_failed", queue=self.queue, error=str(exc))
            return
        self.claims.renewed(renewed, sent)

    async def _release(self, claim: Claim) -> None:
        """Free a claim that never began, its attempt not counted; it ends."""
        try:
            await self.store.abandon_leases(
                self.queue, claim.ids, claim.token, refund=True, suspects=claim.suspects()
            )
        except StoreError as exc:
            log.warning("worker_abandon_failed", queue=self.queue, error=str(exc))
        self.claims.end(claim)

    async def _record_failure(
        self, session: WorkerSession, claim: Claim, row: StoredMessage, exc: Exception
    ) -> None:
        """The message's outcome could not be committed: a failed attempt, with backoff.

        Its handler may have succeeded, but what it wrote was rolled back (a
        deferred constraint, a send the store refused...): the attempt failed.
        """
        outcomes = Outcomes()
        # A StoreError's text already names the driver error: "doing: Type: message".
        text = str(exc) if isinstance(exc, StoreError) else describe(exc)
        failure = because(OutcomeNotRecorded(text), exc)
        policy = self.dispatcher.policy(Received(row))
        self.dispatcher.failures.failed(row, failure, policy, outcomes)
        try:
            async with session.batch() as tx:
                if self.dead_letter is not None:
                    await copy_failed(tx, self.queue, self.dead_letter, [row], outcomes)
                if not await tx.finish(self.queue, outcomes, claim.token):
                    if not tx.begun:
                        log.warning("lease_lost", queue=self.queue, messages=1, batch=1)
                        return
                    raise LeaseLost("another claim took the message after its lease lapsed")
        except DatabaseUnavailable:
            raise
        except LeaseLost as lost:
            # Rolled back, the failure port's copy with it: the other claim's outcome stands.
            log.warning("lease_lost", queue=self.queue, messages=1, batch=1, error=str(lost))
            return
        except Exception as again:
            log.error("outcome_not_recorded", queue=self.queue, message_id=row.id, error=str(again))
            await self.store.abandon_leases(self.queue, [row.id], claim.token)
            return
        claim.committed.add(row.id)
        self.handled += 1
        self.outcomes.update(sq or "released" for sq in outcomes.subqueue)
        if self.metrics is not None:
            self.metrics.committed([row], outcomes, whole_batch=False)

    async def _run_batch(
        self,
        session: WorkerSession,
        claim: Claim,
        batch: list[StoredMessage],
        sizer: BatchSizer | None,
        loop: int | str,
    ) -> Claim | None:
        # A batch whose handlers all declared no outside effects runs without
        # savepoints. When one of them fails after writing, the transaction is
        # rolled back and the batch runs again with savepoints, that failure
        # standing: nothing of the first run was visible, and no handler that
        # could have effects elsewhere ran in it.
        # Each message is decoded once (type, headers) for all that follows.
        received = [Received(m) for m in batch]
        unguarded = self.settings.handler_concurrency == 1 and self.replayable(received)
        failed: dict[int, BaseException] = {}
        conflicts = 0
        # What the claim had committed before this run (the batch's size, for the metrics).
        base = len(claim.committed)
        while True:
            try:
                return await self._run_batch_once(
                    session, claim, received, sizer, loop, unguarded, failed, base
                )
            except Replay as replay:
                self.replays += 1
                unguarded = False
                if replay.error is not None:
                    failed[replay.row.id] = replay.error
                # Only the part not committed yet was rolled back; run again, it starts
                # afresh (nothing of it was visible: a stop gives its attempts back).
                received = [r for r in received if r.row.id not in claim.committed]
                claim.started.difference_update(r.row.id for r in received)
            except StoreError as exc:
                # A deadlock or serialization failure outside the handlers: the batch
                # was rolled back; run it again under the same claim (no attempt spent).
                if conflicts >= MAX_CONFLICT_RETRIES or not is_conflict(exc):
                    raise
                conflicts += 1
                await asyncio.sleep(random.uniform(0.01, 0.05) * conflicts)
                # Only the part not committed yet was rolled back, and runs again afresh.
                received = [r for r in received if r.row.id not in claim.committed]
                claim.started.difference_update(r.row.id for r in received)

    def replayable(self, received: list[Received]) -> bool:
        registry = self.dispatcher.registry
        if not registry.all_replayable and not all(registry.replayable(r.cls) for r in received):
            return False
        # A reply is handed to the request waiting for it as it is handled, which
        # a rolled-back run cannot take back: a batch with one keeps its savepoints.
        return not any(r.mentions(IN_REPLY_TO_HEADER) for r in received)

    async def _run_batch_once(
        self,
        session: WorkerSession,
        claim: Claim,
        received: list[Received],
        sizer: BatchSizer | None,
        loop: int | str,
        unguarded: bool,
        failed: dict[int, BaseException],
        base: int,
    ) -> Claim | None:
        began = time.monotonic()
        batch = [r.row for r in received]
        outcomes = Outcomes()
        done: list[Effects] = []
        debug = debug_enabled()
        self.dispatcher.start_batch()
        partial = False
        sagas = SagaLocks.found(self.dispatcher.registry)
        # The transaction the saga locks are told has ended (they let go of what
        # they took for it in this process), committed or not.
        ended: Batch | None = None
        ahead: Claim | None = None
        try:
            async with session.batch() as tx:
                ended = tx
                later: set[int] = set()
                # Time spent taking the batch's sagas (waiting for other batches),
                # which its size has no part in: the sizer does not count it.
                waited = time.monotonic()
                if sagas is not None:
                    later = await sagas.prepare(tx, received, False, self.saga_table)
                waited = time.monotonic() - waited
                first = [r for r in received if r.row.id not in later] if later else received
                run = (outcomes, done, debug, claim, unguarded, failed)
                await self._handle(tx, first, *run)
                if later:
                    # What needed a saga another batch held: after a commit (which lets
                    # go of this batch's own), its locks are waited for, then it runs.
                    waited += await self._commit_part(tx, received, outcomes, done, claim)
                    rest = [r for r in received if r.row.id in later]
                    await self._handle(tx, rest, *run)
                await self._write(tx, received, batch, outcomes, done)
                if sizer is not None:
                    sizer.observe(len(batch), time.monotonic() - began - waited)
                # The next batch is claimed by the finish's own statement; not by a
                # batch that holds sagas, which other batches may be waiting for: the
                # claim would keep them waiting longer.
                if sizer is not None and not self._stopping.is_set() and not _holds_sagas(received):
                    await self.renew_lapsed()
                    token, since = self.claims.token(loop), time.monotonic()
                    changed, rows = await tx.finish_and_claim(
                        self.queue,
                        outcomes,
                        claim.token,
                        sizer.limit,
                        self.settings.lease_seconds,
                        token,
                    )
                    # Its lease runs from the statement (clock_timestamp), sent after since.
                    ahead = self.claims.take(token, rows, since)
                else:
                    changed = await tx.finish(self.queue, outcomes, claim.token)
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
        except BaseException as exc:
            if ahead is not None:
                if isinstance(exc, asyncio.CancelledError):
                    pass  # its commit's fate unknown: left to the stop, which lets go of it
                else:
                    # Rolled back with the finish (then nothing holds its token), or its
                    # COMMIT's fate unknown: what it may hold goes back, never started.
                    await asyncio.shield(self._release(ahead))
            raise
        finally:
            if ended is not None and sagas is not None:
                sagas.done(ended)
        self.handled += len(outcomes)
        self.outcomes.update(sq or "released" for sq in outcomes.subqueue)
        claim.committed.update(outcomes.ids)
        if self.metrics is not None and not partial:
            # One batch, whatever the parts it was committed in.
            self.metrics.committed(batch, outcomes, size=len(claim.committed) - base)
        return ahead

    async def _handle(
        self,
        tx: Batch,
        received: list[Received],
        outcomes: Outcomes,
        done: list[Effects],
        debug: bool,
        claim: Claim,
        unguarded: bool,
        failed: dict[int, BaseException],
    ) -> None:
        """Run the handlers of ``received`` in ``tx``, adding their outcomes and effects."""
        if self.settings.handler_concurrency > 1 and len(received) > 1:
            await self._handle_concurrently(tx, received, outcomes, done, debug, claim)
            return
        mode = Unguarded(tx) if unguarded else Savepoints(tx)
        interval = self.settings.batch_commit_interval
        # One clock read per message; a commit only once a part took long.
        due = time.monotonic() + interval
        last = received[-1] if received else None
        for item in received:
            message = item.row
            if failed and message.id in failed:
                # Failed after writing in a run that was rolled back: not run
                # again, and its attempt counts even when the worker is stopping.
                claim.started.add(message.id)
                policy = self.dispatcher.policy(item)
                with structlog.contextvars.bound_contextvars(
                    message_id=message.id, message_type=message.label
                ):
                    error = failed[message.id]
                    self.dispatcher.failures.failed(message, error, policy, outcomes)
                continue
            if claim.lapsed() and message.id not in claim.started:
                # Another claim may be running it already: not started here, and given
                # back after the batch (process) if this claim still holds it.
                claim.skipped.append(message)
                continue
            if self._stopping.is_set():
                # Not started now: back to I at once, its attempt not counted unless
                # it ran under this claim before (in a batch that failed and was split).
                outcomes.add(message.id, None, correction=0 if message.id in claim.started else -1)
                continue
            claim.started.add(message.id)
            await self.dispatcher.handle(mode, item, outcomes, done, debug)
            if time.monotonic() >= due and item is not last:
                await self._commit_part(tx, received, outcomes, done, claim)
                due = time.monotonic() + interval

    async def _write(
        self,
        tx: Batch,
        received: list[Received],
        batch: list[StoredMessage],
        outcomes: Outcomes,
        effects: list[Effects],
    ) -> None:
        """Before a finish: the saga states the handlers changed, what they sent, and
        the failure port's copies of the messages going to F."""
        sagas = SagaLocks.found(self.dispatcher.registry)
        if sagas is not None:
            await sagas.flush(tx, received)
        if effects:
            await store_effects(tx, self.queue, effects)
        if self.dead_letter is not None and not outcomes.all_processed:
            await copy_failed(tx, self.queue, self.dead_letter, batch, outcomes)

    async def _commit_part(
        self,
        tx: Batch,
        received: list[Received],
        outcomes: Outcomes,
        done: list[Effects],
        claim: Claim,
    ) -> float:
        """Commit the outcomes and effects of the batch's handlers that are done so far.

        Between two handlers (no savepoint open): their sends are stored, their
        rows finished, and the transaction committed; the rest of the batch goes
        on in a new one, its rows still leased to its claim. Returns the
        seconds the rest then took to take its sagas again.
        """
        batch = [r.row for r in received]
        part = outcomes.take()
        effects = done[:]
        done.clear()
        sagas = SagaLocks.found(self.dispatcher.registry)
        await self._write(tx, received, batch, part, effects)
        # Nothing done yet (the whole batch waits for its sagas): no statement.
        changed = await tx.finish(self.queue, part, claim.token) if len(part) else 0
        lost = len(part) - changed
        if lost and tx.begun:
            raise LeaseLost(
                f"{lost} of {len(part)} messages were taken over by another worker after "
                "their lease expired; rolling back this part of the batch"
            )
        await tx.commit()
        claim.committed.update(part.ids)
        # Counted as soon as committed: the rest of the batch may still fail.
        self.handled += len(part)
        self.outcomes.update(sq or "released" for sq in part.subqueue)
        if lost:
            log.warning("lease_lost", queue=self.queue, messages=lost, batch=len(part))
        elif self.metrics is not None:
            self.metrics.committed(batch, part, whole_batch=False)
        if sagas is None:
            return 0.0
        rest = [r for r in received if r.row.id not in claim.committed]
        if self._stopping.is_set():
            # A stopping worker starts none of the rest: it takes nothing again.
            sagas.released(tx, rest)
            return 0.0
        # The commit let go of the saga locks: the rest of the batch takes its own
        # again, all at once, holding nothing meanwhile.
        began = time.monotonic()
        await sagas.prepare(tx, rest, True, self.saga_table)
        return time.monotonic() - began

    async def _handle_concurrently(
        self,
        tx: Batch,
        received: list[Received],
        outcomes: Outcomes,
        done: list[Effects],
        debug: bool,
        claim: Claim,
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
        running = len(received)
        finished = asyncio.Event()

        async def one(item: Received) -> None:
            nonlocal running
            message = item.row
            try:
                async with slots:
                    if committer.done():
                        return  # a part's commit failed: so does the rest of the batch
                    if claim.lapsed() and message.id not in claim.started:
                        claim.skipped.append(message)  # given back after the batch
                        return
                    if self._stopping.is_set():
                        correction = 0 if message.id in claim.started else -1
                        outcomes.add(message.id, None, correction=correction)
                        return
                    claim.started.add(message.id)
                    serial = SerialBatch(tx, lock)
                    try:
                        await self.dispatcher.handle(serial, item, outcomes, done, debug)
                    finally:
                        serial.let_go()
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
                    await self._commit_part(tx, received, outcomes, done, claim)

        # Named after the loop's task, so a probe that finds the event loop blocked
        # names the loop whose handler holds it (nmbus/telemetry/health.py).
        owner = asyncio.current_task()
        prefix = owner.get_name() if owner is not None else "batch"
        committer = asyncio.create_task(commit_now_and_then(), name=f"{prefix}/commit")
        try:
            # A TaskGroup: if one fails outside its handler (a database error while
            # rolling back), the others are cancelled and the batch fails as a whole.
            async with asyncio.TaskGroup() as group:
                for item in received:
                    group.create_task(one(item), name=f"{prefix}/handler")
        except BaseException:
            # A commit under way is let finish, so what it committed is known.
            finished.set()
            await asyncio.gather(committer, return_exceptions=True)
            raise
        # A commit that failed (or found leases lost) fails the rest of the batch.
        await committer


def _holds_sagas(received: list[Received]) -> bool:
    """Whether the batch's saga locks took sagas for it (their locks are held to its commit)."""
    return any(r.sagas is not None and r.sagas.held for r in received)
