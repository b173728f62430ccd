"""Side tasks that must not vanish: run one, and restart it whenever it dies.

A listener that died silently would leave a queue waiting for its slow poll,
a lease renewer that died would let running handlers' messages be taken over.
Each side task of a bus runs under :func:`supervise`: a failure is logged
(``background_task_failed``, without frame locals) and the task started again
after a pause that grows up to ``max_pause``. Only the owner's cancellation
stops it; a task that returns on its own is done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from nmbus.logs import log_failure

# A task that ran this long before failing starts again with the shortest pause.
HEALTHY_SECONDS = 60.0


async def supervise(
    run: Callable[[], Coroutine[Any, Any, None]],
    name: str,
    logger: Any,
    max_pause: float,
    **fields: Any,
) -> None:
    loop = asyncio.get_running_loop()
    pause = 0.1
    while True:
        started = loop.time()
        try:
            await run()
            return  # finished on its own (nothing to do): not a failure
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            failure: BaseException = exc
        except Exception as exc:
            failure = exc
        if loop.time() - started > HEALTHY_SECONDS:
            pause = 0.1
        log_failure(
            logger,
            "background_task_failed",
            failure,
            task=name,
            restart_in=round(pause, 3),
            **fields,
        )
        await asyncio.sleep(pause)
        pause = min(max_pause, pause * 2)
