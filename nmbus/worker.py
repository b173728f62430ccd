"""The worker: claim a batch, handle it in one transaction, record the outcomes.

Where a message is at every step:

1. ``claim``: one committed UPDATE takes up to ``batch_size`` ready rows with
   ``FOR UPDATE SKIP LOCKED``, counts the attempt (``retry_count + 1``) and
   leases them to this process (``handling_client_id``, ``lease_expires``).
   A process that dies simply lets the lease run out; the attempt stays counted.
2. One transaction on the loop's own connection handles the batch. A handler
   that touches ``ctx.connection`` gets a savepoint (lazily), so its failure
   undoes only its own writes; what handlers send is buffered. The transaction
   itself begins only with the first such write: a batch of handlers that
   write nothing costs no BEGIN and no COMMIT round trip.
3. The buffered messages are inserted and the outcomes (X, R with
   ``retry_time``, F with ``error_info``) are written by one statement each;
   then one COMMIT (or, with no transaction, the finish commits by itself).
   The row changes only if this process still holds its lease.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import traceback
import weakref
from collections import defaultdict
from collections.abc import AsyncIterator, Coroutine, Generator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, cast

import structlog
from pydantic import ValidationError

from nmbus.context import Context
from nmbus.errors import DatabaseUnavailable, PermanentError, RetryLater, StoreError
from nmbus.handlers import HandlerFunc
from nmbus.logs import log_failure
from nmbus.messages import Envelope, Message, StoredMessage
from nmbus.retry import RetryPolicy
from nmbus.store import Batch, Outcomes, WorkerSession
from nmbus.subscriptions import decode_type

if TYPE_CHECKING:
    from nmbus.bus import Bus

log = structlog.get_logger("nmbus.worker")

MAX_ERROR_INFO = 8000
# The longest retry delay written (100 years): beyond it a timestamp overflows.
MAX_DELAY = 100 * 365.25 * 86400

_GATES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Gate] = weakref.WeakKeyDictionary()


def _process_gate() -> _Gate:
    """The one gate of this process's event loop, shared by all its workers."""
    loop = asyncio.get_running_loop()
    gate = _GATES.get(loop)
    if gate is None:
        gate = _GATES[loop] = _Gate()
    return gate


# StoredMessage.recovered, as the claim query computes it.
FRESH, LET_GO, DIED_IN_BATCH, DIED_ALONE = 0, 1, 2, 3


class LeaseLost(StoreError):
    """Another worker took over messages of this batch (our lease ran out)."""


def _storable(text: str) -> str:
    """``text`` as PostgreSQL text can hold it: no NUL, no lone surrogate."""
    text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:
        text = f"<str() of this {type(exc).__name__} failed>"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def error_info(exc: BaseException, headline: str | None = None) -> str:
    """``Type: message`` on the first line (the statistics job groups by it), then the trace.

    Whatever the exception holds (NUL, lone surrogates, a ``__str__`` that
    raises), the result can be stored: the real error is never lost to it.
    """
    lines = (headline or _describe(exc)).splitlines()
    first = lines[0] if lines else type(exc).__name__
    try:
        trace = "".join(traceback.format_exception(exc))
    except Exception:
        trace = f"(the traceback of this {type(exc).__name__} could not be formatted)"
    text = _storable(f"{first}\n{trace}")
    return text if len(text) <= MAX_ERROR_INFO else text[: MAX_ERROR_INFO - 3] + "..."


def _retry_delay(seconds: float) -> float:
    if math.isnan(seconds) or seconds < 0:
        return 0.0
    return min(seconds, MAX_DELAY)


def _per_message_logs() -> bool:
    """Whether to log a line per message: only when the application configured structlog.

    A library must be quiet by default; unconfigured, structlog would print
    every line, one per message handled.
    """
    return structlog.is_configured()


def _debug_enabled() -> bool:
    if not _per_message_logs():
        return False
    bound = log.bind()
    check = getattr(bound, "is_enabled_for", None)
    return bool(check(logging.DEBUG)) if check is not None else True


def _cancelled_from_outside() -> bool:
    """Whether this task is being cancelled (shutdown), not just seeing a stray CancelledError."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class _Gate:
    """Batches of one process share it; a suspect after a crash runs with it alone.

    While a suspect runs, no other handler of the process does (whatever Bus
    it belongs to): if the process dies, the suspect alone is to blame.
    """

    __slots__ = ("_idle", "_open", "_running")

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._running = 0

    @property
    def closed(self) -> bool:
        return not self._open.is_set()

    async def enter(self) -> None:
        while not self._open.is_set():
            await self._open.wait()
        self._running += 1
        self._idle.clear()

    def leave(self) -> None:
        self._running -= 1
        if not self._running:
            self._idle.set()

    @asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        while not self._open.is_set():
            await self._open.wait()
        self._open.clear()
        try:
            await self._idle.wait()
            yield
        finally:
            self._open.set()


async def _call(func: HandlerFunc, message: Message, ctx: Context, timeout: float) -> None:
    """Run one handler under ``timeout``; one that never waits costs no timer at all.

    Starting the coroutine by hand tells whether it finishes without waiting; a
    timer (``asyncio.timeout``, a heap entry made and cancelled) is armed only for
    one that waits, around the rest of its run. Most no-op or CPU-only handlers
    thus skip a few microseconds of timer bookkeeping per message.
    """
    coro = cast("Coroutine[Any, Any, None]", func(message, ctx))
    try:
        first = coro.send(None)
    except StopIteration:
        return
    async with asyncio.timeout(timeout):
        await _Resumed(coro, first)


class _Resumed:
    """Await the rest of a coroutine that has already yielded ``first``, as ``await`` would."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, None], first: Any) -> None:
        self._coro = coro
        self._first = first

    def __await__(self) -> Generator[Any, Any, None]:
        coro, value = self._coro, self._first
        while True:
            try:
                received = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:
                try:
                    value = coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    value = coro.send(received)
                except StopIteration:
                    return


class _SerialBatch:
    """The batch as one of several concurrent handlers sees it.

    Its first savepoint takes the batch's connection lock, held until the
    worker lets go after the handler's savepoint is released or rolled back;
    a subscriber lookup without the lock takes it just for that query.
    """

    __slots__ = ("_batch", "_held", "_lock")

    def __init__(self, batch: Batch, lock: asyncio.Lock) -> None:
        self._batch = batch
        self._lock = lock
        self._held = False

    @property
    def connection(self) -> Any:
        return self._batch.connection

    async def savepoint(self) -> None:
        if not self._held:
            await self._lock.acquire()
            self._held = True
        await self._batch.savepoint()

    async def release_savepoint(self) -> None:
        await self._batch.release_savepoint()

    async def rollback_savepoint(self) -> None:
        await self._batch.rollback_savepoint()

    async def insert(self, queue: str, from_endpoint: str, envelopes: Sequence[Envelope]) -> int:
        if self._held:
            return await self._batch.insert(queue, from_endpoint, envelopes)
        async with self._lock:
            return await self._batch.insert(queue, from_endpoint, envelopes)

    async def subscribers(self, publisher: str, types: Sequence[str]) -> list[str]:
        if self._held:
            return await self._batch.subscribers(publisher, types)
        async with self._lock:
            return await self._batch.subscribers(publisher, types)

    async def publish(
        self, publisher: str, envelopes: Sequence[Envelope], chains: Sequence[str]
    ) -> dict[str, int]:
        if self._held:
            return await self._batch.publish(publisher, envelopes, chains)
        async with self._lock:
            return await self._batch.publish(publisher, envelopes, chains)

    async def finish(self, queue: str, outcomes: Outcomes, client_id: str) -> int:
        return await self._batch.finish(queue, outcomes, client_id)

    def let_go(self) -> None:
        if self._held:
            self._held = False
            self._lock.release()


class Worker:
    """All worker loops of one Bus on its own queue."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.queue = bus.endpoint
        self.settings = bus.settings
        self._wakeup = asyncio.Event()
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.in_flight: set[int] = set()
        # Rows a cancelled loop still holds: started (attempt counted) or not.
        self._abandoned: set[int] = set()
        self._unstarted: set[int] = set()
        self.handled = 0
        self.default_timeout = bus.settings.handler_timeout
        self._gate: _Gate | None = None

    # -- life cycle -------------------------------------------------------------

    def start(self) -> None:
        self._gate = _process_gate()
        for index in range(self.settings.concurrency):
            task = asyncio.create_task(self._loop(index), name=f"nmbus-worker-{self.queue}-{index}")
            self._tasks.append(task)

    def wake(self) -> None:
        self._wakeup.set()

    async def stop(self) -> None:
        """Finish in-flight handlers (up to ``shutdown_timeout``), return the rest to I."""
        self._stopping.set()
        self._wakeup.set()
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
                await self.bus.store.abandon_leases(
                    self.queue, sorted(ids), self.bus.client_id, refund=refund
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
                async with self.bus.store.worker_session() as session:
                    if backoff > 0.1:
                        log.info("worker_reconnected", queue=self.queue, loop=index)
                    backoff = 0.1
                    await self._serve(session)
            except asyncio.CancelledError:
                if _cancelled_from_outside():
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
        while ahead or not self._stopping.is_set():
            self._wakeup.clear()
            if ahead:
                batch, ahead = ahead, []
            else:
                batch = await session.claim(
                    self.queue, settings.batch_size, self.bus.client_id, settings.lease_seconds
                )
            if batch:
                ahead = await self._run_gated(session, batch)
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
        gate = self._gate or _process_gate()
        if any(m.recovered for m in batch):
            batch = await self._isolate(session, batch)
            # Held while it waits for the process to go quiet: keep its lease alive.
            self.in_flight.update(m.id for m in batch)
            async with gate.alone():
                return await self._process(session, batch, claim_ahead=True)
        if gate.closed:
            self.in_flight.update(m.id for m in batch)
        await gate.enter()
        try:
            return await self._process(session, batch, claim_ahead=True)
        finally:
            gate.leave()

    async def _isolate(
        self, session: WorkerSession, batch: list[StoredMessage]
    ) -> list[StoredMessage]:
        """After a crash, keep one suspect to run alone and let the rest of the batch go.

        A worker that died with several messages in hand cannot say which one
        killed it. Every attempt that died counts, but a message is failed for
        dying (AttemptsExhausted) only when it died alone: each suspect is
        tried on its own, with no other handler of this process running. So a
        message that keeps killing workers ends in F and its batch-mates do
        not. The rows let go get this claim's attempt back at once (committed
        before the suspect runs); those still to be tried alone keep a mark.
        """
        suspect = next((m for m in batch if m.recovered == DIED_ALONE), None)
        if suspect is None:
            suspect = next(m for m in batch if m.recovered)
        ids = [m.id for m in batch]
        marks = [m is not suspect and bool(m.recovered) for m in batch]
        await session.isolate(self.queue, ids, suspect.id, marks, self.bus.client_id)
        if _per_message_logs():
            log.warning(
                "message_isolated",
                queue=self.queue,
                message_id=suspect.id,
                attempts=suspect.retry_count,
                released=len(batch) - 1,
            )
        return [suspect]

    # -- one batch ---------------------------------------------------------------

    async def _process(
        self, session: WorkerSession, batch: list[StoredMessage], claim_ahead: bool = False
    ) -> list[StoredMessage]:
        """Handle ``batch``; return the next batch when it was claimed along with the finish."""
        ids = [m.id for m in batch]
        self.in_flight.update(ids)
        started: set[int] = set()
        try:
            return await self._run_batch(session, batch, claim_ahead, started)
        except asyncio.CancelledError:
            self._abandoned.update(started)
            self._unstarted.update(i for i in ids if i not in started)
            raise
        except DatabaseUnavailable:
            raise
        except LeaseLost as exc:
            # Another worker has these rows now; running them again here would be a waste.
            log.warning("lease_lost", queue=self.queue, batch=len(batch), error=str(exc))
            return []
        except Exception as exc:
            if len(batch) > 1:
                # One message may be spoiling the batch: try each alone, still
                # under the same claim, so one poison pill cannot fail the others.
                log.warning(
                    "batch_failed_splitting", queue=self.queue, size=len(batch), error=str(exc)
                )
                for message in batch:
                    await self._process(session, [message])
                return []
            log.error("batch_failed", queue=self.queue, message_id=ids[0], error=str(exc))
            await self._record_failure(session, batch[0], exc)
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
        text = (
            _describe(exc) if not isinstance(exc, StoreError) else _describe(exc).split(": ", 1)[-1]
        )
        headline = _storable(f"OutcomeNotRecorded: {text}".splitlines()[0])
        self._failed(row, exc, self._policy(row), outcomes, headline)
        try:
            async with session.batch() as tx:
                await tx.finish(self.queue, outcomes, self.bus.client_id)
        except DatabaseUnavailable:
            raise
        except Exception as again:
            log.error("outcome_not_recorded", queue=self.queue, message_id=row.id, error=str(again))
            await self.bus.store.abandon_leases(self.queue, [row.id], self.bus.client_id)

    def _policy(self, row: StoredMessage) -> RetryPolicy:
        cls = decode_type(row.label, row.msg_headers)
        handlers = self.bus.registry.handlers_for(cls) if cls is not None else ()
        return (handlers[0].retry if handlers else None) or self.bus.retry

    async def _run_batch(
        self,
        session: WorkerSession,
        batch: list[StoredMessage],
        claim_ahead: bool,
        started: set[int],
    ) -> list[StoredMessage]:
        outcomes = Outcomes()
        outbox: list[tuple[str | None, Envelope]] = []
        debug = _debug_enabled()
        async with session.batch() as tx:
            if self.settings.handler_concurrency > 1 and len(batch) > 1:
                await self._handle_concurrently(tx, batch, outcomes, outbox, debug, started)
            else:
                for message in batch:
                    if self._stopping.is_set():
                        # Never started: back to I at once; the attempt does not count.
                        outcomes.add(message.id, None, correction=-1)
                        continue
                    started.add(message.id)
                    await self._handle(tx, message, outcomes, outbox, debug)
            if outbox:
                await self._flush(tx, outbox)
            ahead: list[StoredMessage] = []
            # The store may claim the next batch in the finish's own statement and
            # commit; a store that cannot just finishes.
            finish_and_claim = getattr(tx, "finish_and_claim", None)
            if claim_ahead and finish_and_claim is not None and not self._stopping.is_set():
                changed, ahead = await finish_and_claim(
                    self.queue,
                    outcomes,
                    self.bus.client_id,
                    self.settings.batch_size,
                    self.settings.lease_seconds,
                )
            else:
                changed = await tx.finish(self.queue, outcomes, self.bus.client_id)
            if changed != len(outcomes) and not getattr(tx, "begun", True):
                # Nothing was written and the finish is already committed: the rows we
                # still held are done, the others are another worker's now.
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
        self.handled += len(batch)
        # Committed: ours, and in flight from now on (the lease renewer must see them).
        self.in_flight.update(m.id for m in ahead)
        return ahead

    async def _handle_concurrently(
        self,
        tx: Batch,
        batch: list[StoredMessage],
        outcomes: Outcomes,
        outbox: list[tuple[str | None, Envelope]],
        debug: bool,
        started: set[int],
    ) -> None:
        """Up to ``handler_concurrency`` handlers of the batch at once, for I/O-bound work.

        The batch's one connection cannot run two statements at once, and a
        handler's savepoint must not interleave with another's: a handler holds
        the batch's connection lock from its first use of ``ctx.connection`` until
        its savepoint is released or rolled back. Handlers that never touch the
        connection never wait for it. Outcomes are still written by one finish.
        """
        slots = asyncio.Semaphore(self.settings.handler_concurrency)
        lock = asyncio.Lock()

        async def one(message: StoredMessage) -> None:
            async with slots:
                if self._stopping.is_set():
                    outcomes.add(message.id, None, correction=-1)
                    return
                started.add(message.id)
                await self._handle(tx, message, outcomes, outbox, debug, lock)

        # A TaskGroup: if one fails outside its handler (a database error while
        # rolling back), the others are cancelled and the batch fails as a whole.
        async with asyncio.TaskGroup() as group:
            for message in batch:
                group.create_task(one(message))

    async def _flush(self, tx: Batch, outbox: list[tuple[str | None, Envelope]]) -> None:
        by_queue: dict[str, list[Envelope]] = defaultdict(list)
        published: list[Envelope] = []
        for queue, envelope in outbox:
            if queue is None:
                published.append(envelope)
            else:
                by_queue[queue].append(envelope)
        for queue, envelopes in by_queue.items():
            await self.bus.store.ensure_queue(queue)
            await tx.insert(queue, self.queue, envelopes)
        if published:
            await self.bus._publish_outbox(tx, published)

    async def _handle(
        self,
        tx: Batch,
        row: StoredMessage,
        outcomes: Outcomes,
        outbox: list[tuple[str | None, Envelope]],
        debug: bool,
        lock: asyncio.Lock | None = None,
    ) -> None:
        bus = self.bus
        cls = decode_type(row.label, row.msg_headers)
        handlers = bus.registry.handlers_for(cls) if cls is not None else ()
        if not handlers:
            reason = (
                f"UnknownMessageType: no message type {row.label!r} is known to endpoint "
                f"{self.queue!r}"
                if cls is None
                else f"NoHandler: endpoint {self.queue!r} has no handler for {row.label!r}"
            )
            if self.settings.on_unknown == "skip":
                outcomes.add(row.id, "X", error_info=f"skipped: {reason}")
                if _per_message_logs():
                    log.warning(
                        "message_skipped", queue=self.queue, message_id=row.id, reason=reason
                    )
            else:
                outcomes.add(row.id, "F", error_info=reason)
                if _per_message_logs():
                    log.error("message_failed", queue=self.queue, message_id=row.id, error=reason)
            return
        assert cls is not None
        try:
            message = cls.model_validate_json(row.msg_text or "")
        except (ValidationError, ValueError) as exc:
            reason = _storable(f"UndecodableMessage: body is not a valid {row.label}: {exc}")
            outcomes.add(row.id, "F", error_info=reason[:MAX_ERROR_INFO])
            if _per_message_logs():
                log.error("message_failed", queue=self.queue, message_id=row.id, error=reason)
            return

        policy = handlers[0].retry or bus.retry
        if row.recovered == DIED_ALONE and row.retry_count > policy.max_attempts:
            reason = (
                f"AttemptsExhausted: {row.retry_count - 1} attempts were started and none "
                "finished (the worker died or lost its lease); not running it again"
            )
            outcomes.add(row.id, "F", error_info=reason)
            if _per_message_logs():
                log.error("message_failed", queue=self.queue, message_id=row.id, error=reason)
            return

        serial = _SerialBatch(tx, lock) if lock is not None else None
        ctx = Context(bus, self.queue, row, serial or tx)
        # ``queue`` is bound once per loop (in _loop); these two change per message.
        tokens = structlog.contextvars.bind_contextvars(message_id=row.id, message_type=row.label)
        try:
            started = time.perf_counter() if debug else 0.0
            try:
                for handler in handlers:
                    await _call(handler.func, message, ctx, handler.timeout or self.default_timeout)
                if ctx._savepoint:
                    # A clean savepoint can be released with the next one (a round
                    # trip saved); stores that cannot defer release it now.
                    defer = None if ctx._tainted else getattr(tx, "defer_release", None)
                    if defer is not None:
                        defer()
                    else:
                        await tx.release_savepoint()
            except BaseException as exc:
                if isinstance(exc, asyncio.CancelledError) and _cancelled_from_outside():
                    raise  # the worker is stopping: not the handler's failure
                if isinstance(exc, KeyboardInterrupt | SystemExit):
                    raise
                if ctx._savepoint:
                    await tx.rollback_savepoint()
                self._failed(row, exc, policy, outcomes)
                return
            outcomes.add(row.id, "X")
            outbox.extend(ctx._outbox)
            if debug:
                log.debug("message_handled", ms=round((time.perf_counter() - started) * 1000, 3))
        finally:
            if serial is not None:
                serial.let_go()
            structlog.contextvars.reset_contextvars(**tokens)

    def _failed(
        self,
        row: StoredMessage,
        exc: BaseException,
        policy: RetryPolicy,
        outcomes: Outcomes,
        headline: str | None = None,
    ) -> None:
        chatty = _per_message_logs()
        if isinstance(exc, RetryLater) and headline is None:
            seconds = _retry_delay(exc.seconds)
            outcomes.add(row.id, "R", delay=seconds, error_info=error_info(exc), correction=-1)
            if chatty:
                log.info("message_retry_later", seconds=seconds, reason=exc.reason)
            return
        if headline is None and isinstance(exc, TimeoutError) and not str(exc):
            headline = "HandlerTimeout: the handler did not finish within its timeout"
        elif headline is None and isinstance(exc, asyncio.CancelledError):
            headline = "HandlerCancelled: cancelled by something other than the worker"
        info = error_info(exc, headline)
        if isinstance(exc, PermanentError) or policy.gives_up_after(row.retry_count):
            outcomes.add(row.id, "F", error_info=info)
            if chatty:
                log.error("message_failed", attempts=row.retry_count, error=info.splitlines()[0])
            return
        seconds = _retry_delay(policy.delay(row.retry_count))
        outcomes.add(row.id, "R", delay=seconds, error_info=info)
        if chatty:
            log.warning(
                "message_retry_scheduled",
                attempts=row.retry_count,
                retry_in=round(seconds, 3),
                error=info.splitlines()[0],
            )
