"""The worker: claim a batch, handle it in one transaction, record the outcomes.

Where a message is at every step:

1. ``claim``: one committed UPDATE takes up to ``batch_size`` ready rows with
   ``FOR UPDATE SKIP LOCKED``, counts the attempt (``retry_count + 1``) and
   leases them to this process (``handling_client_id``, ``lease_expires``).
   A process that dies simply lets the lease run out; the attempt stays counted.
2. One transaction on the loop's own connection handles the batch. A handler
   that touches ``ctx.connection`` gets a savepoint (lazily), so its failure
   undoes only its own writes; what handlers send is buffered.
3. The buffered messages are inserted and the outcomes (X, R with
   ``retry_time``, F with ``error_info``) are written by one statement each;
   then one COMMIT. The row changes only if this process still holds its lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections import defaultdict
from typing import TYPE_CHECKING

import structlog
from pydantic import ValidationError

from nmbus.context import Context
from nmbus.errors import DatabaseUnavailable, PermanentError, RetryLater, StoreError
from nmbus.messages import Envelope, StoredMessage
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
        self._abandoned: set[int] = set()
        self.handled = 0

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
        if self._abandoned:
            ids, self._abandoned = sorted(self._abandoned), set()
            try:
                await self.bus.store.abandon_leases(self.queue, ids, self.bus.client_id)
            except StoreError as exc:
                log.warning("worker_abandon_failed", queue=self.queue, ids=len(ids), error=str(exc))

    # -- the loop -----------------------------------------------------------------

    async def _loop(self, index: int) -> None:
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
            except Exception:
                log.exception("worker_error", queue=self.queue, loop=index)
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
        while not self._stopping.is_set():
            self._wakeup.clear()
            batch = await session.claim(
                self.queue, settings.batch_size, self.bus.client_id, settings.lease_seconds
            )
            if batch:
                if len(batch) > 1 and any(m.recovered for m in batch):
                    batch = await self._isolate_recovered(session, batch)
                await self._process(session, batch)
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

    async def _process(self, session: WorkerSession, batch: list[StoredMessage]) -> None:
        ids = [m.id for m in batch]
        self.in_flight.update(ids)
        try:
            await self._run_batch(session, batch)
        except asyncio.CancelledError:
            self._abandoned.update(ids)
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
                return
            log.error("batch_failed", queue=self.queue, message_id=ids[0], error=str(exc))
            await self.bus.store.abandon_leases(self.queue, ids, self.bus.client_id)
        finally:
            self.in_flight.difference_update(ids)

    async def _run_batch(self, session: WorkerSession, batch: list[StoredMessage]) -> None:
        outcomes = Outcomes()
        outbox: list[tuple[str | None, Envelope]] = []
        debug = _debug_enabled()
        async with session.batch() as tx:
            for message in batch:
                if self._stopping.is_set():
                    # Never started: back to I at once, and the attempt does not count.
                    outcomes.add(message.id, None, correction=-1)
                    continue
                await self._handle(tx, message, outcomes, outbox, debug)
            if outbox:
                await self._flush(tx, outbox)
            changed = await tx.finish(self.queue, outcomes, self.bus.client_id)
            if changed != len(outcomes):
                raise LeaseLost(
                    f"{len(outcomes) - changed} of {len(outcomes)} messages were taken over by "
                    "another worker after their lease expired; rolling back this batch"
                )
        self.handled += len(batch)

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

        ctx = Context(bus, self.queue, row, tx)
        tokens = structlog.contextvars.bind_contextvars(
            message_id=row.id, message_type=row.label, queue=self.queue
        )
        try:
            started = time.perf_counter() if debug else 0.0
            try:
                for handler in handlers:
                    async with asyncio.timeout(handler.timeout or self.settings.handler_timeout):
                        await handler.func(message, ctx)
                if ctx._savepoint:
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
