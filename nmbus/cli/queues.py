"""``nmbus queues create|drop|list|ddl``: queue tables."""

from __future__ import annotations

from typing import Annotated

import typer

from nmbus.cli import app
from nmbus.cli._common import (
    DsnOption,
    JsonOption,
    SchemaOption,
    YesOption,
    confirm,
    emit_json,
    operate,
    queue_name,
    run,
    settings,
    table,
)
from nmbus.ops.admin import Admin, schema_ddl
from nmbus.settings import Settings

queues = typer.Typer(help="Queue tables: create, drop, list, show DDL.", no_args_is_help=True)
app.add_typer(queues, name="queues")

Names = Annotated[list[str], typer.Argument(help="queue names")]


@queues.command("ddl")
def ddl(
    queue: Annotated[str, typer.Argument(help="example queue name")] = "billing",
    schema: SchemaOption = None,
) -> None:
    """Print the DDL of the schema and one queue table (needs no database)."""
    typer.echo(schema_ddl(schema or Settings().schema_name, queue), nl=False)


async def _create(cfg: Settings, names: list[str]) -> None:
    # Not through operate(): this is the one command that makes a missing schema.
    async with Admin.from_settings(cfg) as admin:
        await admin.create_queues(names)


@queues.command("create")
def create(
    names: Names, dsn: DsnOption = None, schema: SchemaOption = None, as_json: JsonOption = False
) -> None:
    """Create queue tables (and the schema) that do not exist yet."""
    cfg = settings(dsn, schema)
    checked = [queue_name(n) for n in names]
    run(_create(cfg, checked))
    if as_json:
        emit_json({"created_or_present": checked})
    else:
        typer.echo(f"ready: {', '.join(checked)}")


@queues.command("drop")
def drop(
    names: Names,
    yes: YesOption = False,
    dsn: DsnOption = None,
    schema: SchemaOption = None,
    as_json: JsonOption = False,
) -> None:
    """Drop queue tables with every message in them. Always asks first, unless --yes."""
    cfg = settings(dsn, schema)
    checked = [queue_name(n) for n in names]
    confirm(f"Drop queue(s) {', '.join(checked)} and every message in them?", yes)
    dropped = operate(cfg, lambda admin: admin.drop_queues(checked))
    if as_json:
        emit_json({"dropped": dropped})
    else:
        typer.echo(f"dropped: {', '.join(dropped)}")


@queues.command("list")
def list_queues(
    dsn: DsnOption = None, schema: SchemaOption = None, as_json: JsonOption = False
) -> None:
    """Names of every queue (see `nmbus status` for what is in them)."""
    cfg = settings(dsn, schema)
    names = operate(cfg, Admin.list_queues)
    if as_json:
        emit_json(names)
    else:
        table(
            f"queues in schema {cfg.schema_name!r}",
            ["queue"],
            [[n] for n in names],
            empty=f"no queues in schema {cfg.schema_name!r}",
        )
