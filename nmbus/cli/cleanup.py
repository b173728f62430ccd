"""``nmbus cleanup``: retention from the command line (see nmbus.postgres.retention)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from nmbus.cli import app
from nmbus.cli._common import (
    DsnOption,
    JsonOption,
    SchemaOption,
    YesOption,
    confirm,
    emit_json,
    errors,
    operate,
    parse_age,
    queue_name,
    settings,
    table,
)
from nmbus.cli._table import Column, age_text, size_text
from nmbus.ops.admin import RetentionPolicy
from nmbus.settings import Settings

MaxAgeOption = Annotated[
    str | None,
    typer.Option(
        metavar="AGE",
        help="remove processed rows older than this: 90s, 30m, 12h, 7d, 2w "
        "(default: the setting retention_max_age, else 7d)",
        show_default=False,
    ),
]
FailedAgeOption = Annotated[
    str | None,
    typer.Option(
        metavar="AGE",
        help="also remove failed rows older than this (default: the setting "
        "retention_failed_max_age, else keep them)",
        show_default=False,
    ),
]


def _counts(cfg: Settings, queues: list[str], policy: RetentionPolicy) -> dict[str, Any]:
    due = operate(cfg, lambda admin: admin.retention_due(policy, queues or None))
    return {d.queue: {"X": d.processed, "F": d.failed} for d in due}


def _clean(
    cfg: Settings, counts: dict[str, Any], policy: RetentionPolicy, quiet: bool
) -> list[dict[str, Any]]:
    total = sum(c["X"] + c["F"] for c in counts.values())
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=errors,
        transient=True,
        disable=quiet,
    ) as progress:
        task = progress.add_task("cleanup", total=total)

        def advance(queue: str, rows: int) -> None:
            progress.update(task, advance=rows, description=f"cleanup {queue}")

        results = operate(cfg, lambda admin: admin.run_retention(policy, list(counts), advance))
    return [
        {
            "queue": result.queue,
            "deleted_processed": result.deleted["X"],
            "deleted_failed": result.deleted["F"],
            "batches": result.batches,
            "longest_batch_seconds": round(result.longest_batch_seconds, 4),
            "files": [str(p) for p in result.files],
            "recovered_files": result.recovered_files,
            "segments_dropped": result.segments_dropped,
            "bytes_freed": result.bytes_freed,
            "rows_moved": result.rows_moved,
            "segments_pinned": result.segments_pinned,
            "payloads_deleted": result.payloads_deleted,
            "orphans_deleted": result.orphans_deleted,
            "skipped": result.skipped,
        }
        for result in results
    ]


@app.command()
def cleanup(
    queues: Annotated[
        list[str] | None, typer.Argument(help="queues to clean (default: every queue)")
    ] = None,
    older_than: MaxAgeOption = None,
    failed_older_than: FailedAgeOption = None,
    batch_size: Annotated[
        int | None, typer.Option(min=1, max=100_000, help="rows per short transaction")
    ] = None,
    archive_dir: Annotated[
        Path | None, typer.Option(help="archive removed rows to Parquet here first")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="only count")] = False,
    yes: YesOption = False,
    dsn: DsnOption = None,
    schema: SchemaOption = None,
    as_json: JsonOption = False,
) -> None:
    """Delete processed rows older than --older-than (NMBUS_RETENTION_MAX_AGE), in batches.

    Failed rows stay unless --failed-older-than (NMBUS_RETENTION_FAILED_MAX_AGE)
    is given. With --archive-dir (NMBUS_RETENTION_ARCHIVE_DIR) each batch is
    written to Parquet, fsynced, and only then deleted. Asks first, unless --yes.
    """
    cfg = settings(dsn, schema)
    base = RetentionPolicy.from_settings(cfg)
    failed_age: timedelta | None = (
        parse_age(failed_older_than, "--failed-older-than")
        if failed_older_than
        else base.failed_max_age
    )
    policy = RetentionPolicy(
        max_age=parse_age(older_than, "--older-than") if older_than else base.max_age,
        failed_max_age=failed_age,
        batch_size=base.batch_size if batch_size is None else batch_size,
        archive_dir=archive_dir or base.archive_dir,
        segment_seconds=base.segment_seconds,
        claim_check_store=base.claim_check_store,
    )
    names = [queue_name(q) for q in queues or []]
    counts = _counts(cfg, names, policy)
    due = sum(c["X"] + c["F"] for c in counts.values())
    if dry_run:
        if as_json:
            emit_json({"dry_run": True, "queues": counts})
        else:
            failed_rule = (
                f"failed rows older than {age_text(policy.failed_max_age)}"
                if policy.failed_max_age
                else "no failed rows (no --failed-older-than)"
            )
            table(
                f"would remove processed rows older than {age_text(policy.max_age)} "
                f"and {failed_rule}",
                [Column("queue", key=True), "X processed", "F failed"],
                [[q, c["X"], c["F"]] for q, c in counts.items()],
                empty="no queues",
            )
        return
    if due:
        where = f", archiving to {policy.archive_dir}" if policy.archive_dir else ""
        confirm(f"Delete {due} old row(s) from {len(counts)} queue(s){where}?", yes)
    results = _clean(cfg, counts, policy, quiet=as_json or due == 0)
    if as_json:
        emit_json({"dry_run": False, "queues": results})
        return
    removed = sum(r["deleted_processed"] + r["deleted_failed"] for r in results)
    dropped = sum(r["segments_dropped"] for r in results)
    freed = sum(r["bytes_freed"] for r in results)
    table(
        f"cleanup: removed {removed} row(s), dropped {dropped} segment(s) ({size_text(freed)})",
        [
            Column("queue", key=True),
            "X deleted",
            "F deleted",
            "segments",
            Column("freed", align="right"),
            "batches",
            "longest batch",
            "files",
            Column("note", wrap=True, min_width=12),
        ],
        [
            [
                r["queue"],
                r["deleted_processed"],
                r["deleted_failed"],
                r["segments_dropped"],
                size_text(r["bytes_freed"]),
                r["batches"],
                age_text(r["longest_batch_seconds"]),
                len(r["files"]),
                "skipped: another run holds it" if r["skipped"] else "",
            ]
            for r in results
        ],
        empty="no queues",
    )
