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
import time
import traceback
from collections import defaultdict
from collections.abc import Coroutine, Generator, Sequence
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


class LeaseLost(StoreError):
    """Another worker took over messages of this batch (our lease ran out)."""


def error_info(exc: BaseException, headline: str | None = None) -> str:
    """``Type: message`` on the first line (the statistics job groups by it), then the trace."""
    first = headline or f"{type(exc).__name__}: {exc}".splitlines()[0]
    trace = "".join(traceback.format_exception(exc))
    text = f"{first}\n{trace}"
    return text if len(text) <= MAX_ERROR_INFO else text[: MAX_ERROR_INFO - 3] + "..."


def _debug_enabled() -> bool:
    bound = log.bind()
    check = getattr(bound, "is_enabled_for", None)
    return bool(check(logging.DEBUG)) if check is not None else True


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

    # -- life cycle -------------------------------------------------------------

    def start(self) -> None:
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
                if len(batch) > 1 and any(m.recovered for m in batch):
                    batch = await self._isolate_recovered(session, batch)
                ahead = await self._process(session, batch, claim_ahead=True)
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

    async def _isolate_recovered(
        self, session: WorkerSession, batch: list[StoredMessage]
    ) -> list[StoredMessage]:
        """Handle a message whose last holder died on its own, releasing the rest first.

        If it kills this process too, no batch-mate loses an attempt to it: they
        were given back (attempt refunded) in a committed statement beforehand.
        """
        suspect = next(m for m in batch if m.recovered)
        released = Outcomes()
        for message in batch:
            if message is not suspect:
                released.add(message.id, None, correction=-1)
        async with session.batch() as tx:
            await tx.finish(self.queue, released, self.bus.client_id)
        log.info("message_isolated", queue=self.queue, message_id=suspect.id)
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
            await self.bus.store.abandon_leases(self.queue, ids, self.bus.client_id)
            return []
        finally:
            self.in_flight.difference_update(ids)

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
                log.warning("message_skipped", queue=self.queue, message_id=row.id, reason=reason)
            else:
                outcomes.add(row.id, "F", error_info=reason)
                log.error("message_failed", queue=self.queue, message_id=row.id, error=reason)
            return
        assert cls is not None
        try:
            message = cls.model_validate_json(row.msg_text or "")
        except (ValidationError, ValueError) as exc:
            reason = f"UndecodableMessage: body is not a valid {row.label}: {exc}"
            outcomes.add(row.id, "F", error_info=reason[:MAX_ERROR_INFO])
            log.error("message_failed", queue=self.queue, message_id=row.id, error=reason)
            return

        policy = handlers[0].retry or bus.retry
        if row.retry_count > policy.max_attempts:
            reason = (
                f"AttemptsExhausted: {row.retry_count - 1} attempts were started and none "
                "finished (the worker died or lost its lease); not running it again"
            )
            outcomes.add(row.id, "F", error_info=reason)
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
            except asyncio.CancelledError:
                raise
            except Exception as exc:
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
        exc: Exception,
        policy: RetryPolicy,
        outcomes: Outcomes,
    ) -> None:
        if isinstance(exc, RetryLater):
            outcomes.add(row.id, "R", delay=exc.seconds, error_info=error_info(exc), correction=-1)
            log.info("message_retry_later", seconds=exc.seconds, reason=exc.reason)
            return
        if isinstance(exc, TimeoutError) and not str(exc):
            headline = "HandlerTimeout: the handler did not finish within its timeout"
            info = error_info(exc, headline)
        else:
            info = error_info(exc)
        if isinstance(exc, PermanentError) or policy.gives_up_after(row.retry_count):
            outcomes.add(row.id, "F", error_info=info)
            log.error("message_failed", attempts=row.retry_count, error=info.splitlines()[0])
            return
        seconds = policy.delay(row.retry_count)
        outcomes.add(row.id, "R", delay=seconds, error_info=info)
        log.warning(
            "message_retry_scheduled",
            attempts=row.retry_count,
            retry_in=round(seconds, 3),
            error=info.splitlines()[0],
        )
