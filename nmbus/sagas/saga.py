"""Sagas: long-running processes whose state is a pydantic model in a table of the endpoint.

``saga = bus.saga(State, key="order_id")`` and ``@saga.handler`` register
ordinary handlers in the endpoint's registry: each one is wrapped so that,
in the handler's own transaction (its savepoint, on ``ctx.connection``), the
saga's row is locked (``SELECT ... FOR UPDATE``, or created by a start
message), the state is given to the handler, and saved (or deleted, once
completed) after it returns. The state, what the handler sends and the
message's move to X commit together, or not at all.

A saga is found by its key: a field of the message (or a callable of the
message), turned into text with ``str()``; a timeout (``ctx.saga.timeout``)
carries its saga's name, key and instance in headers instead, and acts on that
instance only.

Before a batch's handlers run, :class:`SagaLocks` locks every saga that the
batch's messages name, in one statement and one order (sorted lock keys), so
that concurrent batches of several loops and processes never deadlock on them.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar, cast, overload

import structlog
from pydantic import BaseModel, ValidationError

from nmbus.context import Context, SagaControl
from nmbus.envelopes import SAGA_HEADER, SAGA_INSTANCE_HEADER, SAGA_KEY_HEADER
from nmbus.errors import (
    ConfigurationError,
    HandlerError,
    PermanentError,
    SagaNotFound,
)
from nmbus.handlers import Registry
from nmbus.logs import per_message_logs
from nmbus.messages import Message
from nmbus.ports.store import SagaKey, SagaTable, Store
from nmbus.retry import RetryPolicy
from nmbus.sagas.locks import SagaLocks, key_text
from nmbus.sagas.states import SagaStates

log = structlog.get_logger("nmbus.saga")

S = TypeVar("S", bound=BaseModel)
SagaFunc = Callable[[Any, Any, Context], Awaitable[None]]
SF = TypeVar("SF", bound=SagaFunc)

#: A NUL character in a state's JSON (an escape not itself escaped): jsonb refuses it.
_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def _first_annotation(func: SagaFunc, param: inspect.Parameter) -> Any:
    """The message class of a saga handler: its first parameter's annotation, resolved.

    Only that one is resolved, in the handler's module, as ``typing.get_type_hints``
    resolves any annotation: the state's class may well be local to a function,
    where resolving every annotation of the handler would fail.
    """
    annotation = param.annotation
    if annotation is inspect.Parameter.empty:
        return None
    if not isinstance(annotation, str):
        return annotation
    only = types.SimpleNamespace(__annotations__={param.name: annotation})
    module = getattr(inspect.unwrap(func), "__globals__", {})
    try:
        return typing.get_type_hints(only, globalns=module)[param.name]
    except Exception as exc:
        raise HandlerError(
            f"cannot resolve the annotation {annotation!r} of saga handler "
            f"{func.__qualname__}: {exc}; pass @saga.handler(SomeMessage)"
        ) from exc


class Saga(Generic[S]):
    """A saga type of one endpoint: its state model, how messages find it, its handlers.

    Built by :meth:`nmbus.Bus.saga`. ``on_missing="ignore"`` makes a non-start
    message for a saga that does not exist go to X instead of F.
    """

    def __init__(
        self,
        model: type[S],
        key: str | Callable[[Any], object],
        *,
        name: str,
        endpoint: str,
        registry: Registry,
        store: Store,
        on_missing: str = "fail",
    ) -> None:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise ConfigurationError(f"a saga's state must be a pydantic model, got {model!r}")
        if issubclass(model, Message):
            raise ConfigurationError("a saga's state is a plain pydantic BaseModel, not a Message")
        try:
            model()
        except ValidationError as exc:
            raise ConfigurationError(
                f"saga state {model.__name__} must be constructible with no arguments "
                f"(give every field a default): {exc.errors()[0]['msg']}"
            ) from None
        if not (isinstance(key, str) and key) and not callable(key):
            raise ConfigurationError("a saga key is a message field name or a callable")
        if on_missing not in ("fail", "ignore"):
            raise ConfigurationError(f"on_missing must be 'fail' or 'ignore', not {on_missing!r}")
        if not isinstance(name, str) or not 0 < len(name) <= 200:
            raise ConfigurationError("a saga name is a string of 1-200 characters")
        self.model = model
        self.key = key
        self.name = name
        self.endpoint = endpoint
        self.on_missing = on_missing
        self._registry = registry
        self._store = store
        self._table: SagaTable | None = None
        self._locks = SagaLocks.of(registry)

    def __repr__(self) -> str:
        return f"<Saga {self.name!r} of {self.endpoint!r}>"

    @property
    def table(self) -> SagaTable:
        if self._table is None:
            self._table = self._store.saga_table(self.endpoint)
        return self._table

    async def load(self, key: object) -> S | None:
        """The committed state of the saga with ``key``; None if never started or completed."""
        try:
            text = key_text(key)
        except PermanentError as exc:
            raise TypeError(str(exc)) from None
        found = await self.table.load(self.name, text)
        return None if found is None else self.model.model_validate_json(found)

    async def _held(self, ctx: Context, name: SagaKey) -> SagaStates:
        """The batch's states holding saga ``name``, taken now if the batch has not.

        The batch takes every saga its messages name before they run; one it
        did not find then (a key callable that raised for the batch and not for
        the handler, say) is locked here, on the handler's
        savepoint, waiting for it.
        """
        received = ctx.received
        states: SagaStates | None = received.sagas
        if states is not None and name in states.held:
            return states
        if states is None:
            states = received.sagas = SagaStates(self.table)
        await states.take(ctx.connection, {name}, wait=True)
        # If the message fails, its savepoint's rollback lets go of the lock.
        ctx.effects.undo.append(lambda: states.forget(name))
        return states

    # -- registration ------------------------------------------------------------

    @overload
    def handler(self, func: SF, /) -> SF: ...

    @overload
    def handler(
        self,
        message: type[Message] | None = None,
        /,
        *,
        start: bool = False,
        retry: RetryPolicy | int | None = None,
        timeout: float | None = None,
    ) -> Callable[[SF], SF]: ...

    def handler(
        self,
        target: Any = None,
        /,
        *,
        start: bool = False,
        retry: RetryPolicy | int | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Register ``async def f(msg, state, ctx)`` for this saga.

        ``start=True``: the message may create the saga (a new state from the
        model's defaults); otherwise a message for a missing saga goes to F
        (``SagaNotFound``) or, with ``on_missing="ignore"``, to X.
        """
        if target is not None and not isinstance(target, type):
            self._add(target, None, start, retry, timeout)
            return target
        message_type = target

        def register(func: SF) -> SF:
            self._add(func, message_type, start, retry, timeout)
            return func

        return register

    def _add(
        self,
        func: SagaFunc,
        message_type: type[Message] | None,
        start: bool,
        retry: RetryPolicy | int | None,
        timeout: float | None,
    ) -> None:
        if not inspect.iscoroutinefunction(func):
            raise HandlerError(f"saga handler {func!r} must be an async function (async def)")
        params = list(inspect.signature(func).parameters.values())
        if len(params) != 3 or any(
            p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params
        ):
            raise HandlerError(
                f"saga handler {func.__qualname__} must take exactly (msg, state, ctx), "
                f"not ({', '.join(p.name for p in params)})"
            )
        if message_type is None:
            message_type = _first_annotation(func, params[0])
        if not (isinstance(message_type, type) and issubclass(message_type, Message)):
            raise HandlerError(
                f"saga handler {func.__qualname__}: annotate its first parameter with the "
                "Message class it handles, or pass @saga.handler(SomeMessage)"
            )
        field = self.key if isinstance(self.key, str) else None
        if field is not None and field not in message_type.model_fields and start:
            raise HandlerError(
                f"saga {self.name!r} is keyed by {field!r}, which start message "
                f"{message_type.__type_name__} does not have"
            )
        run = self._wrap(func, start, field)
        self._registry.add(run, message_type, retry, timeout)
        self._locks.add(run, self, field)

    def _wrap(self, func: SagaFunc, start: bool, field: str | None) -> Callable[..., Any]:
        saga = self

        async def run(msg: Message, ctx: Context) -> None:
            headers = ctx.headers
            is_timeout = bool(headers) and headers.get(SAGA_HEADER) == saga.name
            # The saga instance a timeout belongs to; None for a timeout sent before
            # schema version 8 (handled as then: by name and key alone).
            owner = headers.get(SAGA_INSTANCE_HEADER) if is_timeout else None
            # Else the key the batch found this saga by, if it found it (SagaLocks).
            found = ctx.received.found
            prepared = next((k for s, k in found if s is saga), None) if found else None
            if is_timeout:
                key = key_text(headers.get(SAGA_KEY_HEADER))
            elif prepared is not None:
                key = prepared
            elif field is not None:
                if not hasattr(msg, field):
                    raise PermanentError(
                        f"{msg.__type_name__} has no field {field!r} to find its "
                        f"{saga.name} saga by"
                    )
                key = key_text(getattr(msg, field))
            else:
                key = key_text(cast("Callable[[Any], object]", saga.key)(msg))
            # With handlers running at once, this one keeps the batch's connection
            # until its message is done: no other saga handler, and no commit of a
            # part of the batch, comes between its read of the state and its change.
            await ctx.hold_connection()
            name = (saga.name, key)
            states = await saga._held(ctx, name)
            held = states.held[name]
            # A timeout of a known instance never creates a saga: its own is gone.
            if held.state is None and not (start and owner is None):
                if is_timeout:
                    # A completed saga's timeouts are expected: nothing to do.
                    ctx.effects.note = (
                        f"saga timeout ignored: the {saga.name} saga with key {key!r} "
                        "that set it has completed"
                    )
                    if per_message_logs():
                        log.info(
                            "saga_timeout_ignored", saga=saga.name, key=key, reason="completed"
                        )
                    return
                if saga.on_missing == "ignore":
                    if per_message_logs():
                        log.info("saga_not_found_ignored", saga=saga.name, key=key)
                    return
                raise SagaNotFound(
                    f"no {saga.name} saga with key {key!r} for {msg.__type_name__}, "
                    "and this handler may not start one"
                )
            if held.state is not None and owner is not None and held.instance != owner:
                why = "completed and started again"
                ctx.effects.note = (
                    f"saga timeout ignored: the {saga.name} saga with key {key!r} "
                    f"that set it has {why}"
                )
                if per_message_logs():
                    log.info("saga_timeout_ignored", saga=saga.name, key=key, reason=why)
                return
            if held.state is None:
                instance = str(uuid.uuid4())
                state = saga.model()
            else:
                instance = held.instance or str(uuid.uuid4())
                state = saga.model.model_validate_json(held.state)
            control = SagaControl(ctx, saga.name, key, instance)
            ctx.use_saga(control)
            try:
                await func(msg, state, ctx)
            finally:
                ctx.use_saga(None)
            saved = None if control.completed else state.model_dump_json()
            if saved is not None and _NUL.search(saved):
                # Written with the batch's states, it would fail the whole batch.
                raise PermanentError(
                    f"the state of the {saga.name} saga with key {key!r} holds a NUL "
                    "character (\\u0000), which PostgreSQL's jsonb cannot store"
                )
            ctx.effects.undo.append(states.change(name, saved, instance))

        run.__module__ = func.__module__
        run.__qualname__ = func.__qualname__
        run.__name__ = func.__name__
        return run
