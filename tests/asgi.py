"""An ASGI application's lifespan, run as a server runs it (httpx's ASGITransport does not).

``async with lifespan(app):`` sends ``lifespan.startup`` and waits for its
completion, and on the way out sends ``lifespan.shutdown`` and waits for that:
the messages of the ASGI lifespan protocol, through the app's one ASGI callable.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]


@asynccontextmanager
async def lifespan(app: ASGIApp) -> AsyncIterator[None]:
    to_app: asyncio.Queue[Message] = asyncio.Queue()
    from_app: asyncio.Queue[Message] = asyncio.Queue()
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
    running = asyncio.create_task(app(scope, to_app.get, from_app.put))

    async def answer() -> Message:
        waiting = asyncio.create_task(from_app.get())
        await asyncio.wait([waiting, running], return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():
            waiting.cancel()
            running.result()  # the app's own exception, if it raised one
            raise RuntimeError("the app returned without answering its lifespan")
        return waiting.result()

    await to_app.put({"type": "lifespan.startup"})
    started = await answer()
    if started["type"] != "lifespan.startup.complete":
        raise RuntimeError(f"startup failed: {started.get('message', '')}")
    try:
        yield
    finally:
        await to_app.put({"type": "lifespan.shutdown"})
        stopped = await answer()
        await running
        if stopped["type"] != "lifespan.shutdown.complete":
            raise RuntimeError(f"shutdown failed: {stopped.get('message', '')}")
