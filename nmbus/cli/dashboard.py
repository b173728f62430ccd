"""``nmbus dashboard``: serve the web dashboard (needs ``nmbus[dashboard]``)."""

from __future__ import annotations

import secrets
from typing import Annotated

import typer

from nmbus.cli import app
from nmbus.cli._common import DsnOption, SchemaOption, fail, run, settings
from nmbus.logs import scrub
from nmbus.ops.admin import Admin

# Changes need a token of at least this many characters.
MIN_TOKEN = 12


@app.command()
def dashboard(
    dsn: DsnOption = None,
    schema: SchemaOption = None,
    host: Annotated[
        str,
        typer.Option(help="address to listen on; any but loopback needs a token"),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="port to listen on")] = 8787,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="NMBUS_DASHBOARD_TOKEN",
            help="secret every change (requeue, purge) must carry; on 127.0.0.1 one is "
            "made up and printed when none is given [env: NMBUS_DASHBOARD_TOKEN]",
            show_default=False,
        ),
    ] = None,
    read_only: Annotated[
        bool, typer.Option("--read-only", help="show everything, change nothing")
    ] = False,
    refresh: Annotated[
        float, typer.Option(min=1.0, max=3600.0, help="seconds between automatic refreshes")
    ] = 5.0,
) -> None:
    """A web dashboard: queues, failed messages (requeue, purge), subscriptions, /metrics."""
    # The extra first: without it nothing below could run, and its missing module
    # must be named as the extra to install, not shown as a traceback.
    try:
        import uvicorn

        from nmbus.dashboard import DashboardOptions, create_app
    except ImportError as exc:
        fail(
            f"the dashboard needs its extra ({exc.name} is missing): pip install 'nmbus[dashboard]'"
        )
    from nmbus.dashboard.hosts import is_loopback, loopback_names

    if not is_loopback(host) and not token:
        fail(
            f"refusing to listen on {host} without a token: pass --token or set "
            "NMBUS_DASHBOARD_TOKEN (or keep the default --host 127.0.0.1)",
            code=2,  # wrong usage (docs/cli.md)
        )
    if token is not None and len(token) < MIN_TOKEN:
        fail(f"the token is too short: use at least {MIN_TOKEN} characters", code=2)
    cfg = settings(dsn, schema)
    made_up = token is None
    secret = token or secrets.token_urlsafe(18)
    admin = Admin.from_settings(cfg, pool_size=4)

    async def serve() -> None:
        if not await admin.schema_exists():
            await admin.close()
            fail(
                f"no nmbus schema {cfg.schema_name!r} in this database: no queues "
                "(check --dsn and --schema)"
            )
        options = DashboardOptions(
            token=secret,
            read_only=read_only,
            refresh_seconds=refresh,
            database=scrub(cfg.dsn or ""),
            # On loopback only this machine's own names are served (no DNS rebinding).
            allowed_hosts=loopback_names(host),
        )
        config = uvicorn.Config(
            create_app(admin, options),
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            server_header=False,
            lifespan="on",
        )
        server = uvicorn.Server(config)
        shown = f"[{host}]" if ":" in host else host
        typer.echo(f"nmbus dashboard on http://{shown}:{port}/ ({options.database})", err=True)
        if read_only:
            typer.echo("read-only: requeue and purge are off", err=True)
        elif made_up:
            typer.echo(f"token for changes (requeue, purge): {secret}", err=True)
        await server.serve()
        if not server.started:
            fail(f"could not listen on {shown}:{port} (in use, or not an address of this host)")

    run(serve())
