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
    connect,
    emit_json,
    fail,
    queue_name,
    run,
    settings,
    table,
)
from nmbus.postgres import PostgresStore
from nmbus.settings import Settings
from nmbus.sql import render
from nmbus.store import SCHEMA_VERSION, validate_schema_name

queues = typer.Typer(help="Queue tables: create, drop, list, show DDL.", no_args_is_help=True)
app.add_typer(queues, name="queues")

Names = Annotated[list[str], typer.Argument(help="queue names")]


def schema_ddl(schema: str, queue: str) -> str:
    """The DDL nmbus runs for a new schema with one queue, as a psql script."""
    validate_schema_name(schema)
    queue = queue_name(queue)

    def literal(value: object) -> str:
        return "'" + str(value).replace("'", "''") + "'"

    header = "\n".join(
        [
            f"-- The DDL nmbus runs for schema {schema!r} with an example queue {queue!r},",
            "-- generated from nmbus/sql/queries.sql (tests/test_cookbook.py keeps it equal):",
            f"--   python -m nmbus queues ddl {queue} --schema {schema} > sql/schema.sql",
            "-- nmbus creates all of this itself at start-up; this file is for reading.",
            "-- Run it as is with: psql -v ON_ERROR_STOP=1 -f sql/schema.sql",
        ]
    )
    statements = [
        render("create_schema", schema),
        render("set_schema_version", schema).replace("$1", literal(SCHEMA_VERSION)),
        render("create_queue", schema, queue),
        render("register_queue", schema).replace("$1", literal(queue)),
    ]
    body = "\n\n".join(s.rstrip().rstrip(";") + ";" for s in statements)
    return f"{header}\n\nBEGIN;\n\n{body}\n\nCOMMIT;\n"


@queues.command("ddl")
def ddl(
    queue: Annotated[str, typer.Argument(help="example queue name")] = "billing",
    schema: SchemaOption = None,
) -> None:
    """Print the DDL of the schema and one queue table (needs no database)."""
    typer.echo(schema_ddl(schema or Settings().schema_name, queue), nl=False)


async def _create(cfg: Settings, names: list[str]) -> None:
    store = PostgresStore(cfg.dsn, cfg.schema_name, 1)
    await store.open()
    try:
        for name in names:
            await store.ensure_queue(name)
    finally:
        await store.close()


async def _drop(cfg: Settings, names: list[str]) -> list[str]:
    # Look before opening the store: opening it installs a missing schema.
    existing = set(await _list(cfg))
    missing = [n for n in names if n not in existing]
    if missing:
        fail(f"no such queue(s): {', '.join(missing)}; nothing dropped")
    store = PostgresStore(cfg.dsn, cfg.schema_name, 1)
    await store.open()
    try:
        for name in names:
            await store.drop_queue(name)
        return names
    finally:
        await store.close()


async def _list(cfg: Settings) -> list[str]:
    # Not through PostgresStore: opening it would install a missing schema, and a
    # listing must never create anything (a typo in --schema would make a schema).
    schema = cfg.schema_name
    async with connect(cfg) as conn:
        return [r[0] for r in await conn.fetch(render("list_queues", schema), schema)]


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
    dropped = run(_drop(cfg, checked))
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
    names = run(_list(cfg))
    if as_json:
        emit_json(names)
    else:
        table(f"queues in {cfg.schema_name!r}", ["queue"], [[n] for n in names])
