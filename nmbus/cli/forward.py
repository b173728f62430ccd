"""``nmbus forward``: move the outbox to the queues of other databases (docs/routes.md).

A Bus with routes and workers already runs a forwarder; this command runs one
alone, for a send-only service or to drain a backlog by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Annotated

import structlog
import typer

from nmbus.cli import app
from nmbus.cli._common import DsnOption, SchemaOption, fail, run, settings
from nmbus.maintenance.supervise import supervise

log = structlog.get_logger("nmbus.cli.forward")


@app.command()
def forward(
    dsn: DsnOption = None,
    schema: SchemaOption = None,
    once: Annotated[bool, typer.Option("--once", help="forward what waits now, then exit")] = False,
) -> None:
    """Forward the outbox to the databases of NMBUS_ROUTES until SIGTERM/SIGINT (or --once)."""
    cfg = settings(dsn, schema)
    routes = cfg.route_dsns()
    if not routes:
        fail(
            "no routes: set NMBUS_ROUTES=queue=alias,... and NMBUS_DB_<ALIAS>=postgresql://...",
            code=2,
        )
    from nmbus.postgres.forwarder import Forwarder
    from nmbus.postgres.pooler import Pooler

    assert cfg.dsn is not None
    forwarder = Forwarder(
        cfg.dsn,
        routes,
        schema=cfg.schema_name,
        batch_size=cfg.forward_batch_size,
        poll_interval=cfg.poll_interval,
        reconnect_max=cfg.reconnect_max_delay,
        pooler=Pooler(cfg.pooler, cfg.listen_dsn),
    )
    if once:

        async def drain() -> int:
            try:
                return await forwarder.forward_all()
            finally:
                await forwarder.close()

        moved = run(drain())
        typer.echo(f"forwarded {moved} message(s) to {len(set(routes.values()))} database(s)")
        return

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        # Supervised like a bus's side task: a lost database restarts it, after a pause.
        side = supervise(forwarder.run, "forwarder", log, cfg.reconnect_max_delay)
        task = asyncio.create_task(side)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    run(serve())
