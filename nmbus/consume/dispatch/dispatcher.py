"""The Dispatcher: one claimed message to its handlers, and what became of it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any, cast

import structlog
from pydantic import ValidationError

from nmbus.consume.dispatch.errorinfo import because
from nmbus.consume.dispatch.failures import Failures
from nmbus.consume.dispatch.replies import ReplyRouting
from nmbus.consume.dispatch.transactions import Replay, Savepoints
from nmbus.consume.isolation import DIED_ALONE
from nmbus.context import Context, Effects
from nmbus.contracts.versions import VERSION_HEADER
from nmbus.delivery.replies import Replies
from nmbus.envelopes import IN_REPLY_TO_HEADER, EnvelopeBuilder, stored_apart
from nmbus.errors import AttemptsExhausted, MessageError, StoreError, UndecodableMessage
from nmbus.handlers import Handler, Registry
from nmbus.messages import Message, StoredMessage
from nmbus.middleware import Link, run_chain
from nmbus.ports.store import Outcomes
from nmbus.received import Received
from nmbus.retry import RetryPolicy
from nmbus.settings import Settings
from nmbus.telemetry.tracer import NULL_TRACER, Tracer, tracer_of

if TYPE_CHECKING:
    from nmbus.telemetry.metrics import WorkerMetrics
    from nmbus.telemetry.tracing import Tracing

log = structlog.get_logger("nmbus.worker")

# Per message class: its handlers, its retry policy, and the validator that decodes
# its bodies when the codec has nothing to do for it (else None: see Dispatcher._plan).
Plan = tuple[tuple[Handler, ...], RetryPolicy, Callable[[str], Message] | None]


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
        # None unless asked for (metrics_port): then a message costs one ``is None`` check.
        self.metrics = metrics
        # None unless opentelemetry is installed; spans only while it is on (start_batch).
        self.tracing = tracing
        # Set by the worker when handlers declare a rate: called just before a
        # handler with a rate is called (nmbus/consume/dispatch/marks.py).
        self.on_start: Callable[[StoredMessage, str], None] | None = None
        self.registry = registry
        self.retry = retry
        self.default_timeout = settings.handler_timeout
        self.builder = builder
        self.failures = Failures(queue, settings.on_unknown, settings.on_expired)
        self.replies = ReplyRouting(registry, replies)
        # Per message class, valid while the registry is unchanged.
        self._plans: dict[type[Message], Plan] = {}
        self._plans_for = -1
        # The tracer of the current batch (start_batch).
        self._tracer: Tracer = NULL_TRACER
        # structlog's context variables for the two keys bound per message.
        tokens = structlog.contextvars.bind_contextvars(message_id=None, message_type=None)
        structlog.contextvars.reset_contextvars(**tokens)
        self._id_var = tokens["message_id"].var
        self._type_var = tokens["message_type"].var

    def start_batch(self) -> None:
        """Once per batch: whether its messages get spans (a provider may be set at any time)."""
        self._tracer = tracer_of(self.tracing)

    def policy(self, received: Received) -> RetryPolicy:
        """The retry policy of the first handler of the message's type, else the endpoint's."""
        cls = received.cls
        handlers = self.registry.handlers_for(cls) if cls is not None else ()
        return (handlers[0].retry if handlers else None) or self.retry

    async def handle(
        self,
        mode: Savepoints,
        received: Received,
        outcomes: Outcomes,
        done: list[Effects],
        debug: bool,
    ) -> None:
        """Handle a message in the batch's transaction ``mode``; add its outcome.

        On success, what its handlers sent is appended to ``done``. In an
        Unguarded batch, a handler that fails after writing raises :class:`Replay`.
        """
        ready = self._ready(received, outcomes)
        if ready is None:
            return
        handlers, message, policy = ready
        row = received.row
        tracer = self._tracer
        ctx = Context(self.queue, received, mode.transaction, self.builder, tracer)
        metrics = self.metrics
        span = tracer.consuming(self.queue, received)
        # ``queue`` is bound once per loop; these two change per message, set on
        # structlog's own context variables (bind_contextvars, without its per-call
        # keyword dict and name formatting).
        id_token = self._id_var.set(row.id)
        type_token = self._type_var.set(row.label)
        failure: BaseException | None = None
        replayed = False
        try:
            started = time.perf_counter() if debug or metrics is not None else 0.0
            try:
                middleware = self.registry.middleware
                if middleware:
                    await self._through(middleware, handlers, message, ctx, row)
                else:
                    # _run's loop, written out: without middleware, a message costs no
                    # coroutine beyond its handlers' (docs/performance.md).
                    on_start = self.on_start
                    for handler in handlers:
                        if on_start is not None and handler.rated:
                            on_start(row, handler.limit_key)
                        coro = cast("Coroutine[Any, Any, None]", handler.func(message, ctx))
                        try:
                            first = coro.send(None)
                        except StopIteration:
                            continue
                        async with asyncio.timeout(handler.timeout or self.default_timeout):
                            await _Resumed(coro, first)
                effects = ctx.effects_made
                if effects is not None and effects.savepoint:
                    if effects.tainted:
                        await mode.release(row)
                    else:
                        mode.keep()
            except Replay:
                replayed = True
                raise
            except BaseException as exc:
                failure = exc
                if isinstance(exc, asyncio.CancelledError) and cancelled_from_outside():
                    raise  # the worker is stopping: not the handler's failure
                if isinstance(exc, KeyboardInterrupt | SystemExit):
                    raise
                if metrics is not None:
                    metrics.handler_ran(row.label, time.perf_counter() - started)
                effects = ctx.effects_made
                if effects is not None:
                    for undo in reversed(effects.undo):
                        undo()
                    if effects.savepoint:
                        replayed = mode.replays
                        await mode.undo(row, exc)
                self.failures.failed(row, exc, policy, outcomes)
                return
            if metrics is not None:
                metrics.handler_ran(row.label, time.perf_counter() - started)
            if effects is not None and effects.note is not None:
                outcomes.add(row.id, "X", error_info=effects.note)
            else:
                outcomes.processed(row.id)
            if effects is not None and (effects.sends or effects.publishes):
                done.append(effects)
            if debug:
                log.debug("message_handled", ms=round((time.perf_counter() - started) * 1000, 3))
        finally:
            try:
                span.end(failure, replayed)
            finally:
                self._type_var.reset(type_token)
                self._id_var.reset(id_token)

    async def _run(
        self, handlers: tuple[Handler, ...], message: Message, ctx: Context, row: StoredMessage
    ) -> None:
        """Call the message's handlers, one after another, each under its timeout."""
        on_start = self.on_start
        for handler in handlers:
            if on_start is not None and handler.rated:
                on_start(row, handler.limit_key)  # marked once it has started
            # A handler that finishes without waiting costs no timer at all;
            # one that waits runs the rest of its course under its timeout.
            coro = cast("Coroutine[Any, Any, None]", handler.func(message, ctx))
            try:
                first = coro.send(None)
            except StopIteration:
                continue
            async with asyncio.timeout(handler.timeout or self.default_timeout):
                await _Resumed(coro, first)

    async def _through(
        self,
        middleware: tuple[Link, ...],
        handlers: tuple[Handler, ...],
        message: Message,
        ctx: Context,
        row: StoredMessage,
    ) -> None:
        """The handlers inside the endpoint's middleware (``@bus.middleware``).

        In the message's own handling, as its handlers are: what a middleware
        raises fails the message as a handler's exception would; one that never
        calls ``call_next`` leaves the message processed without its handlers.
        The whole is bounded by the handlers' timeouts added up, plus the
        endpoint's ``handler_timeout`` for the middleware's own work, so that a
        middleware that never returns cannot hold its batch for ever (and a
        handler's own timeout always comes first).
        """
        default = self.default_timeout
        bound = default + sum(h.timeout or default for h in handlers)
        async with asyncio.timeout(bound):
            await run_chain(
                middleware,
                message,
                ctx,
                lambda: self._run(handlers, message, ctx, row),
                "middleware",
            )

    def _ready(
        self, received: Received, outcomes: Outcomes
    ) -> tuple[tuple[Handler, ...], Message, RetryPolicy] | None:
        """The handlers, message and policy to run; None when the outcome is already added.

        An expired message, a reply that is not for the handlers, one that no
        handler takes, a body that does not decode, or a message that killed its
        workers more often than its policy allows attempts, runs no handler.
        """
        row = received.row
        if row.expired:
            self.failures.expired(row, outcomes)
            return None
        cls = received.cls
        headers = row.msg_headers
        if (
            cls is not None
            and headers
            and IN_REPLY_TO_HEADER in headers
            and self.replies.route(received, cls, outcomes)
        ):
            return None
        if self._plans_for is self.registry.version and cls is not None:
            plan = self._plans.get(cls) or self._plan(cls)
        else:
            plan = self._plan(cls)
        if plan is None:
            self.failures.unhandled(row, cls, outcomes)
            return None
        handlers, policy, validate = plan
        message = received.message
        if message is not None:
            received.message = None
        else:
            assert cls is not None  # a plan is made for a known class only
            try:
                if validate is not None and (headers is None or VERSION_HEADER not in headers):
                    # A version-1 body of a version-1 class with no encrypted field:
                    # the codec would only validate it (Dispatcher._validator).
                    message = validate(row.msg_text or "")
                else:
                    message = self.registry.codec.decode(cls, row.msg_text or "", headers)
            except MessageError as exc:  # a version or key no retry can change
                self.failures.refused(row, exc, outcomes)
                return None
            except (ValidationError, ValueError) as exc:
                if row.msg_text is None and (apart := stored_apart(row.msg_headers)):
                    # The claim check: its payload was not found, or its store could not
                    # be read; tried again as the policy says (docs/messages.md).
                    unread = StoreError(f"its body {apart} was not found or could not be read")
                    self.failures.failed(row, unread, policy, outcomes)
                    return None
                undecodable = UndecodableMessage(f"body is not a valid {row.label}: {exc}")
                self.failures.refused(row, because(undecodable, exc), outcomes)
                return None
        if row.recovered == DIED_ALONE and row.retry_count > policy.max_attempts:
            exhausted = AttemptsExhausted(
                f"{row.retry_count - 1} attempts were started and none finished "
                "(the worker died or lost its lease); not running it again"
            )
            self.failures.refused(row, exhausted, outcomes)
            return None
        return handlers, message, policy

    def _plan(self, cls: type[Message] | None) -> Plan | None:
        """The handlers and policy of ``cls``; None when no handler takes it."""
        if self._plans_for is not self.registry.version:
            self._plans.clear()
            self._plans_for = self.registry.version
        plan = self._plans.get(cls) if cls is not None else None
        if plan is None:
            handlers = self.registry.handlers_for(cls) if cls is not None else ()
            if not handlers:
                return None
            assert cls is not None
            plan = (handlers, handlers[0].retry or self.retry, self._validator(cls))
            self._plans[cls] = plan
        return plan

    def _validator(self, cls: type[Message]) -> Callable[[str], Message] | None:
        """``cls``'s own validator when the codec has nothing to do for its version-1
        bodies, else None (every body then goes through the codec).

        The codec changes a body only to open encrypted fields or to upcast one
        whose version differs from the class's. A class of version 1 with no
        encrypted field has neither for a body without a version header (one
        of version 1; no upcaster applies to it, whatever is registered); a
        body with the header may be newer, which the codec refuses.
        """
        if cls.__version__ != 1 or self.registry.codec.seals(cls):
            return None
        return cast("Callable[[str], Message]", cls.__pydantic_validator__.validate_json)
