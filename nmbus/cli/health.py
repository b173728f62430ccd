"""``nmbus health QUEUE``: one line and exit 0 when a process of QUEUE can work, else 1.

For exec probes (Kubernetes ``exec``, Docker ``HEALTHCHECK``, a cron check): the
same checks as a worker's ``/readyz`` (docs/operations.md, "Health probes"),
from a process of its own: the database answers within ``--timeout``, its
nmbus schema is at the version this nmbus expects, and the queue has its
table. What it cannot see is whether a worker runs: the database keeps no
record of an idle worker; a worker's ``/healthz`` says that.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from nmbus.cli import app
from nmbus.cli._common import (
    DsnOption,
    SchemaOption,
    fail,
    queue_name,
    run,
    server_address,
    settings,
)
from nmbus.ops.admin import Admin, Readiness


@app.command()
def health(
    queue: Annotated[str, typer.Argument(help="the queue its processes work on")],
    dsn: DsnOption = None,
    schema: SchemaOption = None,
    timeout: Annotated[
        float,
        typer.Option(
            min=0.1, max=300.0, help="seconds the whole check may take", show_default=True
        ),
    ] = 5.0,
) -> None:
    """Exit 0 when QUEUE's processes can work on this database, else 1; one line either way.

    Checks that the database answers within --timeout, that its nmbus schema is
    at the version this nmbus expects, and that QUEUE has its table. For exec
    probes; a worker's own probes are /healthz and /readyz on its metrics port.
    """
    cfg = settings(dsn, schema)
    name = queue_name(queue)
    where = server_address(cfg.dsn or "")

    async def check() -> Readiness:
        async with Admin.from_settings(cfg) as admin:
            return await admin.readiness(name)

    async def bounded() -> Readiness:
        try:
            async with asyncio.timeout(timeout):
                return await check()
        except TimeoutError:
            fail(f"no answer from {where} within {timeout:g} s")

    found = run(bounded())
    problem = found.problem(cfg.schema_name, name)
    if problem is not None:
        fail(f"{problem} ({where})")
    typer.echo(
        f"ok: queue {name!r}, schema {cfg.schema_name!r} at version {found.schema_version}, "
        f"on {where}"
    )
