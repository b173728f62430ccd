"""``nmbus cancel QUEUE --unique-id ID | --correlation-id ID``: messages that must not start."""

from __future__ import annotations

from typing import Annotated

import typer

from nmbus.cli import app
from nmbus.cli._common import (
    DsnOption,
    JsonOption,
    SchemaOption,
    emit_json,
    operate,
    queue_name,
    settings,
)


@app.command()
def cancel(
    queue: Annotated[str, typer.Argument(help="queue of the messages")],
    unique_id: Annotated[
        str | None, typer.Option("--unique-id", help="the message sent with this unique_id")
    ] = None,
    correlation_id: Annotated[
        str | None,
        typer.Option("--correlation-id", help="every message with this correlation_id"),
    ] = None,
    dsn: DsnOption = None,
    schema: SchemaOption = None,
    as_json: JsonOption = False,
) -> None:
    """Cancel messages that have not started: they go to F, error_info "Cancelled ...".

    A message a worker holds (running, or claimed and about to start) or one
    already done is left alone and not counted. Nothing is lost: a cancelled
    message can be requeued with 'nmbus failed requeue', so no --yes is asked.
    """
    if (unique_id is None) == (correlation_id is None):
        raise typer.BadParameter("say which: --unique-id ID or --correlation-id ID (one of them)")
    cfg = settings(dsn, schema)
    name = queue_name(queue)
    count = operate(
        cfg, lambda admin: admin.cancel(name, unique_id=unique_id, correlation_id=correlation_id)
    )
    if as_json:
        emit_json({"queue": name, "cancelled": count})
    else:
        typer.echo(f"cancelled {count} message(s) in {name}")
