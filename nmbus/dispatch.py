"""Dispatch: one claimed row to its handlers, and what became of it.

For each row of a batch the worker asks the :class:`Dispatcher`, which decodes
the body (UnknownMessageType, NoHandler and UndecodableMessage go to F or are
skipped), runs the handlers under their timeout with a :class:`Context`, and
adds the row's outcome to the batch's :class:`Outcomes`: X, R after the retry
policy's delay, or F, with a storable ``error_info``. It writes nothing: the
worker records every outcome of a batch in one statement.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
import traceback
from collections.abc import Coroutine, Generator, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

import structlog
from pydantic import ValidationError

from nmbus.context import Context, Effects
from nmbus.envelopes import (
    IN_REPLY_TO_HEADER,
    REPLY_BY_HEADER,
    REQUESTER_HEADER,
    EnvelopeBuilder,
    decode_type,
)
from nmbus.errors import (
    AttemptFailed,
    AttemptsExhausted,
    Expired,
    HandlerCancelled,
    HandlerTimeout,
    MessageError,
    NoHandler,
    PermanentError,
    RetryLater,
    SagaNotFound,
    UndecodableMessage,
    UnknownMessageType,
)
from nmbus.handlers import Handler, Registry
from nmbus.messages import Message, StoredMessage, lookup_type
from nmbus.recovery import DIED_ALONE, is_conflict
from nmbus.replies import Replies
from nmbus.retry import RetryPolicy
from nmbus.settings import Settings
from nmbus.store import Batch, Outcomes

if TYPE_CHECKING:
    from nmbus.metrics import WorkerMetrics
    from nmbus.tracing import Tracing

log = structlog.get_logger("nmbus.worker")

MAX_ERROR_INFO = 8000
# The longest retry delay written (100 years): beyond it a timestamp overflows.
MAX_DELAY = 100 * 365.25 * 86400
# How long a reply for a request of another process of this endpoint waits
# before it is offered again (it is claimed at random by the endpoint's workers):
# 50 ms at first, growing with its age up to 5 s, so that the replies of a
# requester that died bounce slowly until their deadline.
HAND_BACK_DELAY = 0.05
HAND_BACK_MAX_DELAY = 5.0
# A reply is handed back for at most an hour after it was sent, whatever deadline
# its headers name: a live requester gets it within a few hand-backs, so after an
# hour its process is gone (or the deadline was forged) and the reply is late.
HAND_BACK_MAX_AGE = 3600.0
# Deadlocks or serialization failures that one message's handlers may lose in this
# process without spending an attempt; beyond, each is a failed attempt, so a
# handler that conflicts every time (a trigger raising 40001) reaches F.
MAX_FREE_CONFLICTS = 10


def _hand_back_delay(row: StoredMessage) -> float | None:
    """How long a reply waits before it is offered again; None when it is too old to."""
    age = (datetime.now(UTC) - row.insert_time).total_seconds()
    if age >= HAND_BACK_MAX_AGE:
        return None
    return min(HAND_BACK_MAX_DELAY, max(HAND_BACK_DELAY, age / 10))


def storable(text: str) -> str:
    """``text`` as PostgreSQL text can hold it: no NUL, no lone surrogate."""
    text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:
        text = f"<str() of this {type(exc).__name__} failed>"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def error_info(exc: BaseException) -> str:
    """``Type: message`` on the first line (the statistics job groups by it), then the trace.

    An exception that was never raised and has no cause (a reason the worker
    records, like ``NoHandler``) is its first line alone. Whatever the
    exception holds (NUL, lone surrogates, a ``__str__`` that raises), the
    result can be stored: the real error is never lost to it.
    """
    lines = describe(exc).splitlines()
    first = lines[0] if lines else type(exc).__name__
    if exc.__traceback__ is None and exc.__cause__ is None:
        text = storable(first)
    else:
        try:
            trace = _user_trace(exc)
        except Exception:
            trace = f"(the traceback of this {type(exc).__name__} could not be formatted)"
        text = storable(f"{first}\n{trace}")
    return text if len(text) <= MAX_ERROR_INFO else text[: MAX_ERROR_INFO - 3] + "..."


def _user_trace(exc: BaseException) -> str:
    """The traceback of ``exc`` from the handler's frame on: the dispatcher's frames
    (its call of the handler, the _Resumed trampoline's ``coro.send``) are left out
    at the top of each exception of the chain, unless nothing else is left."""
    shown = traceback.TracebackException.from_exception(exc)
    todo, seen = [shown], set()
    while todo:
        part = todo.pop()
        if id(part) in seen:
            continue
        seen.add(id(part))
        frames = list(part.stack)
        ours = next((n for n, f in enumerate(frames) if f.filename != __file__), 0)
        if ours:
            part.stack = traceback.StackSummary.from_list(frames[ours:])
        todo += [p for p in (part.__cause__, part.__context__) if p is not None]
        todo += getattr(part, "exceptions", None) or []
    return "".join(shown.format())


def because(failure: AttemptFailed | MessageError, cause: BaseException) -> BaseException:
    """``failure`` with ``cause`` as its ``__cause__``, as ``raise failure from cause`` would."""
    failure.__cause__ = cause
    return failure


def _retry_delay(seconds: float) -> float:
    if math.isnan(seconds) or seconds < 0:
        return 0.0
    return min(seconds, MAX_DELAY)


def _not_yet(when: object) -> bool:
    """Whether ISO 8601 time ``when`` is still to come (False for anything unreadable)."""
    if not isinstance(when, str):
        return False
    try:
        moment = datetime.fromisoformat(when)
    except ValueError:
        return False
    if moment.tzinfo is None:
        return False
    return moment > datetime.now(UTC)


def _trace(row: StoredMessage, ctx: Context) -> Mapping[str, Any]:
    """The headers to read a trace context from: none unless they name one (no JSON parse)."""
    raw = row.msg_headers
    if not raw or "traceparent" not in raw:
        return {}
    try:
        return ctx.headers
    except ValueError:
        return {}


def per_message_logs() -> bool:
    """Whether to log a line per message: only when the application configured structlog.

    A library must be quiet by default; unconfigured, structlog would print
    every line, one per message handled.
    """
    return structlog.is_configured()


def debug_enabled() -> bool:
    if not per_message_logs():
        return False
    bound = log.bind()
    check = getattr(bound, "is_enabled_for", None)
    return bool(check(logging.DEBUG)) if check is not None else True


def cancelled_from_outside() -> bool:
    """Whether this task is being cancelled (shutdown), not just seeing a stray CancelledError."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


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


class SerialBatch:
    """The batch's connection as one of several concurrent handlers sees it.

    Its first savepoint takes the batch's connection lock, held until the
    dispatcher lets go, after the handler's savepoint is released or rolled
    back: the savepoints of two handlers never interleave on one connection.
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

    def let_go(self) -> None:
        if self._held:
            self._held = False
            self._lock.release()


class Unguarded:
    """The batch's transaction for a handler without outside effects: no savepoint.

    Its first use of ``ctx.connection`` only begins the batch's transaction.
    When such a handler fails after writing (or may have left the transaction
    aborted), the dispatcher raises :class:`Replay` and the worker rolls the
    whole batch back and runs it again, with savepoints.
    """

    __slots__ = ("_batch",)

    def __init__(self, batch: Batch) -> None:
        self._batch = batch

    @property
    def connection(self) -> Any:
        return self._batch.connection

    async def savepoint(self) -> None:
        await self._batch.begin()


class Replay(Exception):
    """A batch run without savepoints must be rolled back and run again with them.

    ``row`` is the message whose handler wrote and then failed (its failure,
    ``error``, stands: it is not run again) or whose writes may have aborted
    the transaction although it returned (``error`` None: it runs again).
    """

    def __init__(self, row: StoredMessage, error: BaseException | None) -> None:
        super().__init__(f"replay the batch of message {row.id}")
        self.row = row
        self.error = error


class Dispatcher:
    """Runs the handlers of one queue's messages and turns what happened into outcomes."""

    def __init__(
        self,
        queue: str,
        registry: Registry,
        retry: RetryPolicy,
        settings: Settings,
        builder: EnvelopeBuilder,
        replies: Replies | None = None,
        *,
        metrics: WorkerMetrics | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.queue = queue
        # Both None unless asked for (metrics_port) or installed (opentelemetry):
        # then a message costs one ``is None`` check for each.
        self.metrics = metrics
        self.tracing = tracing
        self.replies = replies
        self.registry = registry
        self.retry = retry
        self.on_unknown = settings.on_unknown
        self.on_expired = settings.on_expired
        self.default_timeout = settings.handler_timeout
        self.builder = builder
        # Per message class: its handlers, its validator and its retry policy,
        # valid while the registry is unchanged.
        self._plans: dict[type[Message], tuple[tuple[Handler, ...], Any, RetryPolicy]] = {}
        self._plans_for = -1
        # Conflicts lost so far by each message that lost one (MAX_FREE_CONFLICTS).
        self._conflicts: dict[int, int] = {}
        # Rows of replies handed to their request: a batch run again (a conflict, a
        # split) must not hand one to its type's handlers as well.
        self._resolved: set[int] = set()
        # The tracing of the current batch: None unless spans are recorded (start_batch).
        self._batch_tracing: Tracing | None = None
        # structlog's context variables for the two keys bound per message.
        tokens = structlog.contextvars.bind_contextvars(message_id=None, message_type=None)
        structlog.contextvars.reset_contextvars(**tokens)
        self._id_var = tokens["message_id"].var
        self._type_var = tokens["message_type"].var

    def start_batch(self) -> None:
        """Once per batch: whether its messages get spans.

        A global tracer provider can be set at any time, and looking for one costs
        OpenTelemetry an environment lookup: once per batch, not per message.
        """
        tracing = self.tracing
        self._batch_tracing = tracing if tracing is not None and tracing.on() else None

    async def handle(
        self,
        tx: Batch,
        row: StoredMessage,
        outcomes: Outcomes,
        done: list[Effects],
        debug: bool,
        lock: asyncio.Lock | None = None,
        unguarded: bool = False,
    ) -> None:
        """Handle ``row`` in batch ``tx``; on success, what it sent is appended to ``done``.

        ``unguarded``: the batch runs without savepoints (every handler in it has
        no outside effects); a handler that fails after writing raises
        :class:`Replay` instead of rolling back to its savepoint.
        """
        if row.expired:
            self.expired(row, outcomes)
            return
        label = row.label
        # The class of a known label, as decode_type would find it first.
        cls = lookup_type(label) if label else None
        if cls is None:
            cls = decode_type(label, row.msg_headers)
        text = row.msg_headers
        if (
            cls is not None
            and text
            and IN_REPLY_TO_HEADER in text
            and self.reply(row, cls, outcomes)
        ):
            return
        if self._plans_for is not self.registry.version:
            self._plans.clear()
            self._plans_for = self.registry.version
        plan = self._plans.get(cls) if cls is not None else None
        if plan is None:
            handlers = self.registry.handlers_for(cls) if cls is not None else ()
            if not handlers:
                self._unhandled(row, cls, outcomes)
                return
            assert cls is not None
            plan = (handlers, cls.__pydantic_validator__, handlers[0].retry or self.retry)
            self._plans[cls] = plan
        handlers, validator, policy = plan
        try:
            # What cls.model_validate_json does, without its wrapper's call.
            message = validator.validate_json(row.msg_text or "")
        except (ValidationError, ValueError) as exc:
            undecodable = because(
                UndecodableMessage(f"body is not a valid {row.label}: {exc}"), exc
            )
            reason = error_info(undecodable)
            outcomes.add(row.id, "F", error_info=reason)
            if per_message_logs():
                log.error("message_failed", queue=self.queue, message_id=row.id, error=reason)
            return

        if row.recovered == DIED_ALONE and row.retry_count > policy.max_attempts:
            reason = error_info(
                AttemptsExhausted(
                    f"{row.retry_count - 1} attempts were started and none finished "
                    "(the worker died or lost its lease); not running it again"
                )
            )
            outcomes.add(row.id, "F", error_info=reason)
            if per_message_logs():
                log.error("message_failed", queue=self.queue, message_id=row.id, error=reason)
            return

        serial = SerialBatch(tx, lock) if lock is not None else None
        tracing = self._batch_tracing
        handle_tx: Any = Unguarded(tx) if unguarded else (serial or tx)
        ctx = Context(self.queue, row, handle_tx, self.builder, tracing)
        effects = ctx.effects
        # ``queue`` is bound once per loop (in _loop); these two change per message,
        # set on structlog's own context variables (bind_contextvars, without its
        # per-call keyword dict and name formatting).
        metrics = self.metrics
        span = None if tracing is None else tracing.consuming(self.queue, row, _trace(row, ctx))
        id_token = self._id_var.set(row.id)
        type_token = self._type_var.set(label)
        failure: BaseException | None = None
        try:
            started = time.perf_counter() if debug or metrics is not None else 0.0
            try:
                for handler in handlers:
                    # A handler that finishes without waiting costs no timer at all;
                    # one that waits runs the rest of its course under its timeout.
                    coro = cast("Coroutine[Any, Any, None]", handler.func(message, ctx))
                    try:
                        first = coro.send(None)
                    except StopIteration:
                        continue
                    async with asyncio.timeout(handler.timeout or self.default_timeout):
                        await _Resumed(coro, first)
                if effects.savepoint:
                    # A clean savepoint can be released with the next one (a round
                    # trip saved); one that may be aborted is released now, so that
                    # its own handler is the one that fails.
                    if unguarded:
                        if effects.tainted:
                            raise Replay(row, None)
                    elif effects.tainted:
                        await tx.release_savepoint()
                    else:
                        tx.defer_release()
            except BaseException as exc:
                failure = exc
                if isinstance(exc, asyncio.CancelledError) and cancelled_from_outside():
                    raise  # the worker is stopping: not the handler's failure
                if isinstance(exc, KeyboardInterrupt | SystemExit | Replay):
                    raise
                if metrics is not None:
                    metrics.handler_ran(row.label, time.perf_counter() - started)
                if effects.savepoint:
                    if unguarded:
                        failure = Replay(row, exc)
                        raise failure from exc
                    await tx.rollback_savepoint()
                self.failed(row, exc, policy, outcomes)
                return
            if metrics is not None:
                metrics.handler_ran(row.label, time.perf_counter() - started)
            if effects.note is None:
                outcomes.processed(row.id)
            else:
                outcomes.add(row.id, "X", error_info=effects.note)
            if effects.sends or effects.publishes:
                done.append(effects)
            if debug:
                log.debug("message_handled", ms=round((time.perf_counter() - started) * 1000, 3))
        finally:
            try:
                if span is not None:
                    if isinstance(failure, Replay):
                        span.end(failure.error, replayed=True)
                    else:
                        span.end(failure)
            finally:
                if serial is not None:
                    serial.let_go()
                self._type_var.reset(type_token)
                self._id_var.reset(id_token)

    def _unhandled(self, row: StoredMessage, cls: type[Message] | None, outcomes: Outcomes) -> None:
        """Record a message no handler here takes: F, or X with ``on_unknown="skip"``."""
        unhandled: MessageError = (
            UnknownMessageType(f"no message type {row.label!r} is known to endpoint {self.queue!r}")
            if cls is None
            else NoHandler(f"endpoint {self.queue!r} has no handler for {row.label!r}")
        )
        reason = error_info(unhandled)
        if self.on_unknown == "skip":
            outcomes.add(row.id, "X", error_info=f"skipped: {reason}")
            if per_message_logs():
                log.warning("message_skipped", queue=self.queue, message_id=row.id, reason=reason)
        else:
            outcomes.add(row.id, "F", error_info=reason)
            if per_message_logs():
                log.error("message_failed", queue=self.queue, message_id=row.id, error=reason)

    def reply(self, row: StoredMessage, cls: type[Message], outcomes: Outcomes) -> bool:
        """Deal with a reply if it is not for the handlers: True when its outcome is added.

        A reply a request of this process waits for resolves that request and
        goes to X (its handlers do not run). One that another live request of
        this endpoint, in another process, waits for goes back for that process
        (to R, shortly, the attempt not counted), for at most ``HAND_BACK_MAX_AGE``
        seconds after the reply was sent. A late one, that no request
        waits for any more, is handled like any message; with no handler it
        goes to X with a note rather than to F.
        """
        try:
            headers = json.loads(row.msg_headers or "")
        except ValueError:
            return False
        if not isinstance(headers, dict) or IN_REPLY_TO_HEADER not in headers:
            return False
        if row.id in self._resolved:
            outcomes.add(row.id, "X")  # its request has it: only its outcome was lost
            return True
        replies = self.replies
        if replies is not None and row.correlation_id in replies:
            try:
                message = cls.model_validate_json(row.msg_text or "")
            except (ValidationError, ValueError):
                return False  # recorded as undecodable by the usual path
            if replies.resolve(row.correlation_id, message):
                if len(self._resolved) >= 10_000:
                    self._resolved.clear()  # bounded; a batch's own are its last few
                self._resolved.add(row.id)
                outcomes.add(row.id, "X")
                if per_message_logs():
                    log.info("reply_received", correlation_id=row.correlation_id)
                return True
        requester = headers.get(REQUESTER_HEADER)
        if (
            requester
            and replies is not None
            and requester != replies.client_id
            and _not_yet(headers.get(REPLY_BY_HEADER))
            and (delay := _hand_back_delay(row)) is not None
        ):
            outcomes.add(row.id, "R", delay=delay, correction=-1)
            return True
        if self.registry.handlers_for(cls):
            return False
        outcomes.add(
            row.id,
            "X",
            error_info=(
                f"late reply: no request waits for correlation id {row.correlation_id!r} "
                "any more (it timed out, or its process stopped) and no handler takes "
                f"{row.label}"
            ),
        )
        if per_message_logs():
            log.info("late_reply", correlation_id=row.correlation_id)
        return True

    def _free_conflict(self, id: int) -> bool:
        """Whether message ``id``'s conflict may cost no attempt (its first MAX_FREE_CONFLICTS)."""
        if len(self._conflicts) >= 10_000 and id not in self._conflicts:
            self._conflicts.clear()  # bounded: forgetting only makes more conflicts free
        lost = self._conflicts[id] = self._conflicts.get(id, 0) + 1
        return lost <= MAX_FREE_CONFLICTS

    def expired(self, row: StoredMessage, outcomes: Outcomes) -> None:
        """Record an expired row without running a handler: F, or X with ``on_expired="drop"``."""
        reason = error_info(
            Expired(f"{row.label} expired before a handler took it (attempt {row.retry_count})")
        )
        if self.on_expired == "drop":
            outcomes.add(row.id, "X", error_info=f"dropped: {reason}")
        else:
            outcomes.add(row.id, "F", error_info=reason)
        if per_message_logs():
            log.warning(
                "message_expired", queue=self.queue, message_id=row.id, action=self.on_expired
            )

    def policy(self, row: StoredMessage) -> RetryPolicy:
        """The retry policy of the first handler of ``row``'s type, else the endpoint's."""
        cls = decode_type(row.label, row.msg_headers)
        handlers = self.registry.handlers_for(cls) if cls is not None else ()
        return (handlers[0].retry if handlers else None) or self.retry

    def failed(
        self,
        row: StoredMessage,
        exc: BaseException,
        policy: RetryPolicy,
        outcomes: Outcomes,
    ) -> None:
        """Add the outcome of a failed attempt: R after the policy's delay, or F."""
        chatty = per_message_logs()
        if isinstance(exc, RetryLater):
            seconds = _retry_delay(exc.seconds)
            outcomes.add(row.id, "R", delay=seconds, error_info=error_info(exc), correction=-1)
            if chatty:
                log.info("message_retry_later", seconds=seconds, reason=exc.reason)
            return
        if isinstance(exc, TimeoutError) and not str(exc):
            exc = because(HandlerTimeout("the handler did not finish within its timeout"), exc)
        elif isinstance(exc, asyncio.CancelledError):
            exc = because(HandlerCancelled("cancelled by something other than the worker"), exc)
        info = error_info(exc)
        if is_conflict(exc) and self._free_conflict(row.id):
            # A deadlock or serialization failure says nothing about the message: its
            # writes were rolled back, it is tried again soon, and the attempt is not spent.
            seconds = _retry_delay(random.uniform(0.05, 0.5))
            outcomes.add(row.id, "R", delay=seconds, error_info=info, correction=-1)
            if chatty:
                log.info(
                    "message_conflict_retry", retry_in=round(seconds, 3), error=info.splitlines()[0]
                )
            return
        if isinstance(exc, PermanentError | SagaNotFound) or policy.gives_up_after(row.retry_count):
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
