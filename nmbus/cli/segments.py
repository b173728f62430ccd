"""``nmbus segments [QUEUE...]``: the segments (partitions) of each queue table."""

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
    plain,
    queue_name,
    settings,
    table,
)
from nmbus.cli._table import Column, size_text


@app.command()
def segments(
    queues: Annotated[
        list[str] | None, typer.Argument(help="queue names (default: every queue)")
    ] = None,
    dsn: DsnOption = None,
    schema: SchemaOption = None,
    as_json: JsonOption = False,
) -> None:
    """Each queue's segments, oldest first: rows, pending, insert times and size.

    A queue table that is not partitioned shows as one segment, number 0.
    "rows" is PostgreSQL's estimate ("~"); "pending" (rows not in X) is
    counted through the partial indexes, never by a scan of processed rows.
    """
    cfg = settings(dsn, schema)
    wanted = [queue_name(q) for q in queues] if queues else None
    found = operate(cfg, lambda admin: admin.queue_segments(wanted))
    if as_json:
        emit_json([plain(s) for s in found])
        return
    table(
        f"segments of the queues in schema {cfg.schema_name!r} (oldest first)",
        [
            Column("queue", key=True),
            Column("segment", key=True),
            "n",
            Column("oldest", align="right"),
            Column("newest", align="right"),
            Column("rows", align="right"),
            "pending",
            Column("size", align="right"),
        ],
        [
            [
                s.queue,
                s.name,
                s.number,
                s.oldest,
                s.newest,
                f"~{s.rows:,}",
                s.pending,
                size_text(s.size_bytes),
            ]
            for s in found
        ],
        empty=f"no queues yet in schema {cfg.schema_name!r}",
    )
