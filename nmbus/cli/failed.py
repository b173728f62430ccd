"""``nmbus failed list|show|requeue|purge``: messages that used up their attempts."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from nmbus.cli import app
from nmbus.cli._common import (
    DsnOption,
    JsonOption,
    SchemaOption,
    YesOption,
    confirm,
    connect,
    console,
    emit_json,
    errors,
    fail,
    queue_name,
    rows_to_dicts,
    run,
    settings,
    table,
)
from nmbus.postgres.store import notify_channel
from nmbus.settings import Settings
from nmbus.sql import render

failed = typer.Typer(help="Failed (F) messages: list, show, requeue, purge.", no_args_is_help=True)
app.add_typer(failed, name="failed")

BATCH = 1000

IdOption = Annotated[
    list[int] | None, typer.Option("--id", help="a message id (repeat for several)")
]
TypeOption = Annotated[str | None, typer.Option("--type", help="only messages of this type")]
AllOption = Annotated[bool, typer.Option("--all", help="every failed message of the queue")]


@failed.command("list")
def list_failed(
    queue: Annotated[str | None, typer.Argument(help="queue (default: every queue)")] = None,
    message_type: TypeOption = None,
    limit: Annotated[int, typer.Option(help="at most this many per queue")] = 100,
    dsn: DsnOption = None,
    schema: SchemaOption = None,
    as_json: JsonOption = False,
) -> None:
    """Failed messages, oldest first, with the first line of their error."""
    cfg = settings(dsn, schema)
    found = run(_list(cfg, queue_name(queue) if queue else None, message_type, limit))
    if as_json:
        emit_json(found)
        return
    table(
        "failed messages",
        ["queue", "id", "type", "attempts", "failed at", "error"],
        [
            [r["queue"], r["id"], r["label"], r["retry_count"], r["last_processed"], r["error"]]
            for r in found
        ],
    )


async def _list(
    cfg: Settings, queue: str | None, message_type: str | None, limit: int
) -> list[dict[str, Any]]:
    schema = cfg.schema_name
    async with connect(cfg) as conn:
        if queue is None:
            queues = [r[0] for r in await conn.fetch(render("list_queues", schema), schema)]
        else:
            await _check_queue(conn, cfg, queue)
            queues = [queue]
        found: list[dict[str, Any]] = []
        for name in queues:
            rows = await conn.fetch(render("ops_failed_list", schema, name), message_type, limit)
            found.extend({"queue": name, **d} for d in rows_to_dicts(rows))
        return found


async def _check_queue(conn: Any, cfg: Settings, queue: str) -> None:
    schema = cfg.schema_name
    if not await conn.fetchval(render("queue_exists", schema), schema, queue):
        fail(f"no queue {queue!r} in schema {schema!r}")


@failed.command("show")
def show(
    queue: Annotated[str, typer.Argument(help="queue of the message")],
    message_id: Annotated[int, typer.Argument(metavar="ID", help="message id")],
    dsn: DsnOption = None,
    schema: SchemaOption = None,
    as_json: JsonOption = False,
) -> None:
    """Every column of one message: its error with traceback, headers and body."""
    cfg = settings(dsn, schema)
    row = run(_show(cfg, queue_name(queue), message_id))
    if row is None:
        fail(f"no message {message_id} in queue {queue!r}")
    if as_json:
        emit_json(row)
        return
    table(
        f"{queue} #{message_id}",
        ["column", "value"],
        [[k, v] for k, v in row.items() if k != "error_info"],
    )
    console.print("[bold]error_info[/bold]")
    console.print(row["error_info"] or "-", markup=False, highlight=False)


async def _show(cfg: Settings, queue: str, message_id: int) -> dict[str, Any] | None:
    async with connect(cfg) as conn:
        await _check_queue(conn, cfg, queue)
        row = await conn.fetchrow(render("ops_message", cfg.schema_name, queue), message_id)
        return rows_to_dicts([row])[0] if row is not None else None


def _selection(ids: list[int] | None, message_type: str | None, every: bool) -> str:
    if every and (ids or message_type):
        raise typer.BadParameter("--all cannot be combined with --id or --type")
    if not (every or ids or message_type):
        raise typer.BadParameter("say which messages: --id N (repeatable), --type T, or --all")
    if every:
        return "every failed message"
    parts = []
    if ids:
        parts.append("ids " + ", ".join(map(str, ids)))
    if message_type:
        parts.append(f"type {message_type!r}")
    return "failed messages with " + " and ".join(parts)


async def _in_batches(
    cfg: Settings,
    queue: str,
    query: str,
    ids: list[int] | None,
    message_type: str | None,
    verb: str,
    extra: tuple[Any, ...],
) -> int:
    schema = cfg.schema_name
    async with connect(cfg) as conn:
        await _check_queue(conn, cfg, queue)
        count_sql = render("ops_failed_count", schema, queue)
        total: int = await conn.fetchval(count_sql, ids, message_type)
        done: int = 0
        with Progress(
            TextColumn(f"{verb} {queue}"),
            BarColumn(),
            MofNCompleteColumn(),
            console=errors,
            transient=True,
            disable=total <= BATCH,
        ) as progress:
            task = progress.add_task(verb, total=total)
            while True:
                sql = render(query, schema, queue)
                if query == "ops_requeue_failed":
                    moved: int = await conn.fetchval(sql, ids, message_type, *extra, BATCH, queue)
                else:
                    moved = await conn.fetchval(sql, ids, message_type, BATCH)
                done += moved
                progress.advance(task, moved)
                if moved < BATCH:
                    return done


@failed.command("requeue")
def requeue(
    queue: Annotated[str, typer.Argument(help="queue of the messages")],
    ids: IdOption = None,
    message_type: TypeOption = None,
    every: AllOption = False,
    yes: YesOption = False,
    dsn: DsnOption = None,
    schema: SchemaOption = None,
    as_json: JsonOption = False,
) -> None:
    """Move failed messages back to I as fresh messages, and wake the queue's workers.

    Attempts restart at 0, they are ready now, any lease is cleared; error_info
    is kept until the next attempt overwrites it. Asks first for --type/--all.
    """
    what = _selection(ids, message_type, every)
    cfg = settings(dsn, schema)
    name = queue_name(queue)
    if every or message_type:
        confirm(f"Requeue {what} in {name!r}?", yes)
    moved = run(
        _in_batches(
            cfg,
            name,
            "ops_requeue_failed",
            ids,
            message_type,
            "requeue",
            (notify_channel(cfg.schema_name),),
        )
    )
    if as_json:
        emit_json({"queue": name, "requeued": moved})
    else:
        typer.echo(f"requeued {moved} message(s) in {name}")
    if ids and moved < len(set(ids)):
        fail(f"{len(set(ids)) - moved} of the given ids are not failed messages of {name}")


@failed.command("purge")
def purge(
    queue: Annotated[str, typer.Argument(help="queue of the messages")],
    ids: IdOption = None,
    message_type: TypeOption = None,
    every: AllOption = False,
    yes: YesOption = False,
    dsn: DsnOption = None,
    schema: SchemaOption = None,
    as_json: JsonOption = False,
) -> None:
    """Delete failed messages for good. Always asks first, unless --yes."""
    what = _selection(ids, message_type, every)
    cfg = settings(dsn, schema)
    name = queue_name(queue)
    confirm(f"Delete {what} in {name!r} for good?", yes)
    gone = run(_in_batches(cfg, name, "ops_purge_failed", ids, message_type, "purge", ()))
    if as_json:
        emit_json({"queue": name, "purged": gone})
    else:
        typer.echo(f"purged {gone} message(s) from {name}")
    if ids and gone < len(set(ids)):
        fail(f"{len(set(ids)) - gone} of the given ids are not failed messages of {name}")
