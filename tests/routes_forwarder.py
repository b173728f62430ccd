"""A forwarder in a process of its own, for the tests that SIGKILL it.

``python -m tests.routes_forwarder DSN QUEUE=REMOTE_DSN [--batch N] [--die-after-commit]``
prints ``ready`` and forwards until killed. With ``--die-after-commit`` it
SIGKILLs itself right after its first remote commit, before the outbox rows
are deleted: the one window where a crash leaves forwarded rows behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from nmbus.postgres.forwarder import Forwarder


class DiesAfterCommit(Forwarder):
    async def _deliver(self, remote: Any, queue: str, rows: Sequence[Any]) -> int:
        # Returns once the remote committed: the outbox rows are not deleted yet.
        inserted = await super()._deliver(remote, queue, rows)
        print(f"committed {len(rows)}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        return inserted


async def main(argv: list[str]) -> None:
    dsn, route = argv[0], argv[1]
    queue, _, remote = route.partition("=")
    batch = int(argv[argv.index("--batch") + 1]) if "--batch" in argv else 50
    kind = DiesAfterCommit if "--die-after-commit" in argv else Forwarder
    forwarder = kind(dsn, {queue: remote}, batch_size=batch, poll_interval=0.5, reconnect_max=0.5)
    print("ready", flush=True)
    await forwarder.run()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
