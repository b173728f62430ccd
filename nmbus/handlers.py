"""The handler registry: which async functions handle which message types.

A handler is ``async def handle(msg: SomeMessage, ctx: Context) -> None``.
The message type comes from the first parameter's annotation and everything is
checked when the decorator runs. A message is dispatched to the handlers of
its class and of every Message base class (most specific first), as NGinn
dispatches along the class chain.
"""

from __future__ import annotations

import inspect
import math
import typing
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from nmbus.context import Context
from nmbus.contracts import Codec
from nmbus.delivery.flow import FlowLimits, Limits
from nmbus.errors import MAX_SECONDS, HandlerError
from nmbus.messages import Message, subtypes, type_name
from nmbus.middleware import Link, checked
from nmbus.retry import RetryPolicy

HandlerFunc = Callable[[Any, Context], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Handler:
    """A registered handler with its message type and options."""

    func: HandlerFunc
    message_type: type[Message]
    retry: RetryPolicy | None
    timeout: float | None
    # False: the handler's only effects go through ctx.connection, ctx.send and
    # ctx.publish, so running it again after a rollback is invisible.
    outside_effects: bool = True
    # Flow control (nmbus/delivery/flow.py): enforced where the messages are claimed.
    limits: Limits | None = None

    @property
    def name(self) -> str:
        return f"{self.func.__module__}.{self.func.__qualname__}"

    @property
    def rated(self) -> bool:
        """Whether it has a rate: its starts are counted (nmbus/consume/dispatch/marks.py)."""
        return self.limits is not None and self.limits.rate is not None

    @property
    def limit_key(self) -> str:
        """What its limits are counted under in every process: its message type and
        function, never its module's name (``__main__`` under ``python -m``)."""
        return f"{type_name(self.message_type)}:{self.func.__qualname__}"


class Registry:
    """Handlers by message class, with a per-class dispatch cache, and the
    middleware that runs around every handling (in registration order)."""

    def __init__(self) -> None:
        #: ``@bus.middleware`` functions, outermost first (nmbus/middleware.py).
        self.middleware: tuple[Link, ...] = ()
        #: How this endpoint's bodies are encoded and decoded (nmbus.contracts).
        self.codec = Codec()
        self._by_type: dict[type[Message], list[Handler]] = {}
        self._dispatch: dict[type[Message], tuple[Handler, ...]] = {}
        # How many registered handlers may have effects outside the database.
        self._outside = 0
        # Changes with every registration: caches built on the registry check it.
        self.version = 0

    def add(
        self,
        func: HandlerFunc,
        message_type: type[Message] | None = None,
        retry: RetryPolicy | int | None = None,
        timeout: float | None = None,
        outside_effects: bool = True,
        limits: Limits | None = None,
    ) -> Handler:
        if not inspect.iscoroutinefunction(func):
            raise HandlerError(f"handler {func!r} must be an async function (async def)")
        params = list(inspect.signature(func).parameters.values())
        positional = [
            p
            for p in params
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        ]
        if len(positional) != 2 or len(params) != 2:
            raise HandlerError(
                f"handler {func.__qualname__} must take exactly (msg, ctx), "
                f"not ({', '.join(p.name for p in params)})"
            )
        if message_type is None:
            try:
                hints = typing.get_type_hints(func)
            except Exception as exc:
                raise HandlerError(
                    f"cannot resolve the annotations of handler {func.__qualname__}: {exc}"
                ) from exc
            message_type = hints.get(positional[0].name)
            if message_type is None:
                raise HandlerError(
                    f"handler {func.__qualname__}: annotate its first parameter with the "
                    "Message class it handles, or pass @bus.handler(SomeMessage)"
                )
        if not (isinstance(message_type, type) and issubclass(message_type, Message)):
            raise HandlerError(
                f"handler {func.__qualname__} handles {message_type!r}, which is not a "
                "subclass of nmbus.Message"
            )
        if timeout is not None and not (math.isfinite(timeout) and 0 < timeout <= MAX_SECONDS):
            raise HandlerError(
                f"handler timeout must be > 0 seconds and finite, at most {MAX_SECONDS} "
                f"(10 years), got {timeout}"
            )
        policy = RetryPolicy.of(retry) if retry is not None else None
        if not isinstance(outside_effects, bool):
            raise HandlerError(
                f"handler {func.__qualname__}: outside_effects must be True or False, "
                f"got {outside_effects!r}"
            )
        handler = Handler(func, message_type, policy, timeout, outside_effects, limits)
        if limits is not None and any(
            h.limits is not None and h.limit_key == handler.limit_key
            for handlers in self._by_type.values()
            for h in handlers
        ):
            raise HandlerError(
                f"two handlers with limits are both {handler.limit_key!r} (a function "
                "registered twice, or made by a factory): give each its own name"
            )
        self._by_type.setdefault(message_type, []).append(handler)
        self._dispatch.clear()
        # A rate counts each start once: its handler is never run again after a rollback.
        self._outside += outside_effects or handler.rated
        self.version += 1
        return handler

    def add_middleware(self, func: Any) -> Link:
        """Add ``async def m(msg, ctx, call_next)`` around every handling, inside the others."""
        link = checked(func, "middleware", "ctx")
        self.middleware = (*self.middleware, link)
        return link

    def handlers_for(self, cls: type[Message]) -> tuple[Handler, ...]:
        """Handlers for ``cls`` and its Message bases, most specific first."""
        found = self._dispatch.get(cls)
        if found is None:
            found = tuple(
                handler
                for base in cls.__mro__
                if isinstance(base, type) and issubclass(base, Message)
                for handler in self._by_type.get(base, ())
            )
            self._dispatch[cls] = found
        return found

    def longest_handling(self, default: float) -> float:
        """The longest the handlers of one message may run: the sum of their timeouts
        (``default`` for a handler without its own), for the message type with the most."""
        return max(
            (sum(h.timeout or default for h in self.handlers_for(cls)) for cls in self._by_type),
            default=default,
        )

    @property
    def all_replayable(self) -> bool:
        """Whether every registered handler declared ``outside_effects=False`` (and no rate)."""
        return not self._outside and bool(self._by_type)

    def replayable(self, cls: type[Message] | None) -> bool:
        """Whether running the handlers of ``cls`` again after a rollback is invisible."""
        if cls is None or not self._outside:
            return True
        return not any(h.outside_effects or h.rated for h in self.handlers_for(cls))

    def flow_limits(self, at_once: int = 1) -> FlowLimits | None:
        """The limits of every limited handler, with the labels each one counts;
        ``at_once``: how many handlers a worker loop runs at once."""
        return FlowLimits.of(
            (
                (h.limit_key, h.limits, [type_name(c) for c in subtypes(h.message_type)])
                for handlers in self._by_type.values()
                for h in handlers
                if h.limits is not None
            ),
            at_once,
        )

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_type.values())

    def __iter__(self) -> Iterator[Handler]:
        """Every registered handler, in registration order within each message type."""
        for handlers in self._by_type.values():
            yield from handlers
