"""Middleware: code an endpoint runs around every message it handles, and around
every message it sends.

``@bus.middleware`` functions wrap each handling (``async def m(msg, ctx,
call_next)``, run by the dispatcher, nmbus/consume/dispatch/dispatcher.py);
``@bus.outgoing`` hooks wrap each outgoing message (``async def h(msg, headers,
call_next)``, run by the envelope builder, nmbus/envelopes.py). Both are
chains: each one calls ``call_next()`` once to go on, in registration order,
and one that returns without calling it stops there. This module holds what
the two have in common: the check when one is registered, and the chain.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from nmbus.errors import ConfigurationError, HandlerError

#: What ``call_next`` is: the rest of the chain.
CallNext = Callable[[], Awaitable[None]]
#: ``async def tenant(msg, ctx, call_next) -> None`` (incoming) or
#: ``async def stamp(msg, headers, call_next) -> None`` (outgoing).
Link = Callable[[Any, Any, CallNext], Awaitable[None]]


def name_of(func: Callable[..., Any]) -> str:
    return getattr(func, "__qualname__", None) or repr(func)


def checked(func: Any, kind: str, second: str) -> Link:
    """``func`` if it can be a link of a chain of ``kind``; HandlerError at once if not.

    An async function (``async def``, not an async generator) of exactly three
    positional parameters: the message, ``second`` and ``call_next``.
    """
    if not inspect.iscoroutinefunction(func):
        what = "an async generator" if inspect.isasyncgenfunction(func) else repr(func)
        raise HandlerError(
            f"{kind} {name_of(func)} must be an async function (async def ... -> None "
            f"that awaits call_next()), not {what}"
        )
    params = list(inspect.signature(func).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) != 3 or len(positional) != 3:
        raise HandlerError(
            f"{kind} {name_of(func)} must take exactly (msg, {second}, call_next), "
            f"not ({', '.join(p.name for p in params)})"
        )
    result: Link = func
    return result


async def run_chain(
    chain: Sequence[Link],
    message: Any,
    second: Any,
    last: CallNext | None,
    kind: str,
) -> Link | None:
    """Run ``chain`` around ``last``: each link gets ``(message, second, call_next)``.

    Returns None when the chain reached its end (``last`` ran), else the link
    that returned without calling ``call_next``. A link that calls it a second
    time gets ConfigurationError (the chain ran already; running the handlers
    or the send twice would be a duplicate no one asked for). What a link or
    ``last`` raises goes through the links before it, as any exception does.
    """
    stopped: Link | None = None

    async def step(index: int) -> None:
        nonlocal stopped
        if index == len(chain):
            if last is not None:
                await last()
            return
        link = chain[index]
        called = False

        async def call_next() -> None:
            nonlocal called
            if called:
                raise ConfigurationError(
                    f"{kind} {name_of(link)} called call_next() a second time: "
                    "the rest of the chain runs once"
                )
            called = True
            await step(index + 1)

        await link(message, second, call_next)
        if not called and stopped is None:
            stopped = link

    await step(0)
    return stopped
