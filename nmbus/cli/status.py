"""``nmbus status``: every queue at a glance."""

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
    seconds_text,
    settings,
    table,
)


@app.command()
def status(
    dsn: DsnOption = None,
    schema: SchemaOption = None,
    window: Annotated[
        float, typer.Option(help="seconds of recent history for latency and failures")
    ] = 600.0,
    as_json: JsonOption = False,
) -> None:
    """Every queue: rows per subqueue, oldest ready age, recent latency and failures."""
    cfg = settings(dsn, schema)
    queues = operate(cfg, lambda admin: admin.queue_status(window))
    if as_json:
        emit_json({"window_seconds": window, "queues": [plain(q) for q in queues]})
        return
    minutes = f"{window / 60:g}m"
    table(
        f"nmbus queues in schema {cfg.schema_name!r} (recent = last {minutes})",
        [
            "queue",
            "I ready",
            "R scheduled",
            "X processed",
            "F failed",
            "in flight",
            "oldest ready",
            f"done {minutes}",
            "avg ms",
            "p99 ms",
            f"failed {minutes}",
        ],
        [
            [
                q.queue,
                q.ready,
                q.scheduled,
                q.processed,
                q.failed,
                q.in_flight,
                seconds_text(q.oldest_ready_seconds),
                q.recent_processed,
                q.recent_avg_ms,
                q.recent_p99_ms,
                q.recent_failed,
            ]
            for q in queues
        ],
    )
    if not queues:
        typer.echo("no queues yet")
    blocked = [(q.queue, b) for q in queues for b in q.blocked]
    if blocked:
        table(
            "blocked sequences (a member in F holds its sequence until requeued or purged)",
            ["queue", "sequence", "blocking id", "in", "attempts", "waiting", "error"],
            [
                [name, b.sequence_key, b.blocking_id, b.subqueue, b.attempts, b.waiting, b.error]
                for name, b in blocked
            ],
        )
