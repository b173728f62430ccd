"""``nmbus failed list|show|requeue|purge``: messages that used up their attempts."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
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
    console,
    emit_json,
    errors,
    fail,
    operate,
    plain,
    queue_name,
    settings,
    table,
)
from nmbus.cli._table import Column
from nmbus.contracts.encryption import readable
from nmbus.contracts.versions import stored_version
from nmbus.envelopes import stored_apart
from nmbus.errors import MessageVersionError
from nmbus.ops.admin import FAILED_BATCH, Admin, FailedCount
from nmbus.settings import Settings

failed = typer.Typer(help="Failed (F) messages: list, show, requeue, purge.", no_args_is_help=True)
app.add_typer(failed, name="failed")

IdOption = Annotated[
    list[int] | None, typer.Option("--id", help="a message id (repeat for several)")
]
TypeOption = Annotated[str | None, typer.Option("--type", help="only messages of this type")]
AllOption = Annotated[bool, typer.Option("--all", help="every failed message of the queue")]


@failed.command("list")
def list_failed(
    queue: Annotated[str | None, typer.Argument(help="queue (default: every queue)")] = None,
    message_type: TypeOption = None,
    limit: Annotated[int, typer.Option(min=1, help="at most this many per queue")] = 100,
    dsn: DsnOption = None,
    schema: SchemaOption = None,
    as_json: JsonOption = False,
) -> None:
    """Failed messages, oldest first, with the first line of their error."""
    cfg = settings(dsn, schema)
    name = queue_name(queue) if queue else None
    found = operate(
        cfg, lambda admin: admin.failed_messages(name, message_type=message_type, limit=limit)
    )
    rows = [plain(m) for m in found]
    if as_json:
        emit_json(rows)
        return
    table(
        "failed messages",
        [
            Column("queue", key=True),
            Column("id", key=True),
            "type",
            "attempts",
            "failed at",
            Column("error", wrap=True),
        ],
        [[m.queue, m.id, m.label, m.retry_count, m.last_processed, m.error] for m in found],
        empty="no failed messages" + (f" in {name}" if name else ""),
    )


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
    name = queue_name(queue)
    found = operate(cfg, lambda admin: admin.message(name, message_id))
    if found is None:
        fail(f"no message {message_id} in queue {queue!r}")
    row = plain(found)
    if as_json:
        # The body's version as a number beside its type: 1 without an nmbus-version
        # header, null for a header that holds no version.
        emit_json(_after(row, "label", "version", _version(row.get("msg_headers"))))
        return
    # Every value whole (full timestamps): this is the one message looked at closely;
    # an encrypted field as its key id (--json gives the stored body as it is).
    row["msg_text"] = readable(row["msg_text"])
    if row["msg_text"] is None:
        row["msg_text"] = stored_apart(row.get("msg_headers"))  # the claim check
    shown = [[k, "-" if v is None else str(v)] for k, v in row.items() if k != "error_info"]
    # The body's version beside its type (no nmbus-version header means version 1).
    at = next((i + 1 for i, (k, _) in enumerate(shown) if k == "label"), len(shown))
    version = _version(row.get("msg_headers"))
    shown.insert(at, ["version", "?" if version is None else str(version)])
    table(f"{queue} #{message_id}", ["column", Column("value", align="left", wrap=True)], shown)
    console.print("[bold]error_info[/bold]")
    console.print(row["error_info"] or "-", markup=False, highlight=False)


def _after(row: dict[str, Any], key: str, name: str, value: Any) -> dict[str, Any]:
    """``row`` with ``name: value`` put right after ``key`` (at the end without it)."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if k != name:
            out[k] = v
        if k == key:
            out[name] = value
    out.setdefault(name, value)
    return out


def _version(headers: str | None) -> int | None:
    """The stored body's version (1 without the header); None for a header that is none."""
    try:
        return stored_version(headers)
    except MessageVersionError:
        return None


def _selection(ids: list[int] | None, message_type: str | None, every: bool) -> str:
    if every and (ids or message_type):
        raise typer.BadParameter("--all cannot be combined with --id or --type")
    if not (every or ids or message_type):
        raise typer.BadParameter("say which messages: --id N (repeatable), --type T, or --all")
    if every:
        return "every failed message"
    parts = []
    one = bool(ids) and len(set(ids or ())) == 1
    if ids:
        parts.append(("id " if one else "ids ") + ", ".join(map(str, dict.fromkeys(ids))))
    if message_type:
        parts.append(f"type {message_type!r}")
    noun = "the failed message" if one and not message_type else "failed messages"
    return f"{noun} with " + " and ".join(parts)


def _not_failed(ids: list[int], changed: int, queue: str) -> str:
    """``2 of the given ids are not failed messages of billing`` (1: ``... is not a ...``)."""
    n = len(set(ids)) - changed
    if n == 1:
        return f"1 of the given ids is not a failed message of {queue}"
    return f"{n} of the given ids are not failed messages of {queue}"


def _count(
    cfg: Settings, queue: str, ids: list[int] | None, message_type: str | None
) -> FailedCount:
    """What a change will act on: counted once, shown in its question, and binding it."""
    return operate(cfg, lambda admin: admin.failed_count(queue, ids=ids, message_type=message_type))


def _in_batches(
    cfg: Settings,
    change: Callable[..., Awaitable[int]],
    verb: str,
    counted: FailedCount,
    ids: list[int] | None,
    message_type: str | None,
    every: bool,
) -> int:
    """``change`` (Admin.requeue_failed or purge_failed) of what ``counted`` counted and
    nothing that failed after it, with a progress bar if many move; says on stderr how
    many more match now (they failed after the count, and were left)."""
    queue, total = counted.queue, counted.count

    async def changing(admin: Admin) -> int:
        with Progress(
            TextColumn(f"{verb} {queue}"),
            BarColumn(),
            MofNCompleteColumn(),
            console=errors,
            transient=True,
            disable=total <= FAILED_BATCH,
        ) as progress:
            task = progress.add_task(verb, total=total)
            done: int = await change(
                admin,
                queue,
                ids=ids,
                message_type=message_type,
                every=every,
                on_batch=lambda _queue, rows: progress.advance(task, rows),
                counted=counted,
            )
        if not ids:
            left = await admin.count_failed(queue, message_type=message_type)
            if left:
                errors.print(
                    f"{left} more matching message(s) failed after the count and were left "
                    f"as they are (run the command again to {verb} them)",
                    markup=False,
                    highlight=False,
                    soft_wrap=True,
                )
        return done

    return operate(cfg, changing)


def _matching(counted: FailedCount) -> str:
    n = counted.count
    return f"{n:,} match{'es' if n == 1 else ''} now; any that fail after this count stay"


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
    counted = _count(cfg, name, ids, message_type)
    if every or message_type:
        confirm(f"Requeue {what} in {name!r}? {_matching(counted)}.", yes)
    moved = _in_batches(cfg, Admin.requeue_failed, "requeue", counted, ids, message_type, every)
    if as_json:
        emit_json({"queue": name, "requeued": moved})
    else:
        typer.echo(f"requeued {moved} message(s) in {name}")
    if ids and moved < len(set(ids)):
        fail(_not_failed(ids, moved, name))


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
    counted = _count(cfg, name, ids, message_type)
    confirm(f"Delete {what} in {name!r} for good? {_matching(counted)}.", yes)
    gone = _in_batches(cfg, Admin.purge_failed, "purge", counted, ids, message_type, every)
    if as_json:
        emit_json({"queue": name, "purged": gone})
    else:
        typer.echo(f"purged {gone} message(s) from {name}")
    if ids and gone < len(set(ids)):
        fail(_not_failed(ids, gone, name))
