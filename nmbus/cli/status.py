"""``nmbus status``: every queue at a glance."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated

import typer

from nmbus.cli import app
from nmbus.cli._common import (
    DsnOption,
    JsonOption,
    SchemaOption,
    emit_json,
    operate,
    parse_age,
    plain,
    settings,
    table,
)
from nmbus.cli._table import Column, age_text, size_text
from nmbus.ops.admin import Admin, LimitStatus, QueueStatus, RouteStatus, SegmentInfo


@dataclass(frozen=True)
class Stored:
    """What a queue's segments add up to: how many, its oldest row's insert_time, size."""

    segments: int
    oldest_insert_time: datetime | None  # of the oldest segment that holds rows
    size_bytes: int

    @classmethod
    def of(cls, found: Sequence[SegmentInfo]) -> Stored:
        oldest = next((s.oldest for s in found if s.oldest is not None), None)
        return cls(len(found), oldest, sum(s.size_bytes for s in found))


@app.command()
def status(
    dsn: DsnOption = None,
    schema: SchemaOption = None,
    window: Annotated[
        str,
        typer.Option(
            metavar="AGE",
            help="recent history for latency and failures: 90s, 10m, 2h, or seconds",
        ),
    ] = "10m",
    exact: Annotated[
        bool,
        typer.Option(
            "--exact",
            help="count X rows one by one (a full scan of each queue) instead of estimating "
            "them on big tables",
        ),
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Every queue: rows per subqueue, oldest ready age, recent latency, failures, segments.

    Its segments: how many, the oldest row's insert time, size on disk.
    I, R and F are exact; X ("~" before it) is estimated on tables over 16 MiB
    from PostgreSQL's live-row count, so this stays fast with millions of
    processed rows (--exact counts them). `nmbus segments` lists each segment.
    Handlers with flow limits are listed with what their limits hold back.
    """
    seconds = parse_age(window, "--window").total_seconds()
    if not 0 < seconds <= 366 * 86400:
        raise typer.BadParameter(
            f"{window!r}: the window must be longer than 0 and at most 366 days",
            param_hint="--window",
        )
    cfg = settings(dsn, schema)

    async def read(
        admin: Admin,
    ) -> tuple[list[QueueStatus], dict[str, Stored], list[LimitStatus]]:
        found = await admin.queue_status(seconds, exact=exact)
        by_queue: dict[str, list[SegmentInfo]] = {}
        for segment in await admin.queue_segments():
            by_queue.setdefault(segment.queue, []).append(segment)
        limits = await admin.flow_status()
        return found, {name: Stored.of(s) for name, s in by_queue.items()}, limits

    queues, by_name, limits = operate(cfg, read)
    # A queue created after its segments were read has none (yet).
    stored = [by_name.get(q.queue, Stored(0, None, 0)) for q in queues]
    routes = operate(cfg, lambda admin: admin.route_status(cfg.route_dsns()))
    if as_json:
        emit_json(
            {
                "window_seconds": seconds,
                "queues": [
                    {
                        **{k: v for k, v in plain(q).items() if k != "windows"},
                        "note": q.created_by_send_note,
                        **plain(d),
                    }
                    for q, d in zip(queues, stored, strict=True)
                ],
                "limits": [plain(limit) for limit in limits],
                "routes": [plain(r) for r in routes],
            }
        )
        return
    minutes = age_text(seconds)
    # At 80 columns this is three tables, each with the queue names: the subqueues,
    # the recent window, then the segments.
    rows, recent, disk = "rows", "recent", "segments"
    table(
        f"nmbus queues in schema {cfg.schema_name!r} (recent = last {minutes})",
        [
            Column("queue", key=True),
            Column("I ready", group=rows),
            Column("R scheduled", group=rows),
            Column("X processed", align="right", group=rows),
            Column("F failed", group=rows),
            Column("in flight", group=rows),
            Column("oldest ready", align="right", group=rows),
            Column(f"done {minutes}", group=recent),
            Column("avg ms", align="right", group=recent),
            Column("p99 ms", align="right", group=recent),
            Column(f"failed {minutes}", group=recent),
            Column("segments", group=disk),
            Column("oldest row", align="right", group=disk),
            Column("size", align="right", group=disk),
        ],
        [
            [
                q.queue,
                q.ready,
                q.scheduled,
                f"~{q.processed:,}" if q.processed_estimated else q.processed,
                q.failed,
                q.in_flight,
                _oldest_ready(q),
                q.recent_processed,
                q.recent_avg_ms,
                q.recent_p99_ms,
                q.recent_failed,
                d.segments,
                d.oldest_insert_time,
                size_text(d.size_bytes),
            ]
            for q, d in zip(queues, stored, strict=True)
        ],
        empty=f"no queues yet in schema {cfg.schema_name!r}",
    )
    _created_by_send(queues)
    blocked = [(q.queue, b) for q in queues for b in q.blocked]
    if blocked:
        table(
            "blocked sequences (a member in F holds its sequence until requeued or purged)",
            [
                Column("queue", key=True),
                Column("sequence", key=True),
                "blocking id",
                "in",
                "attempts",
                "waiting",
                Column("error", wrap=True),
            ],
            [
                [name, b.sequence_key, b.blocking_id, b.subqueue, b.attempts, b.waiting, b.error]
                for name, b in blocked
            ],
        )
    _limits_table(limits)
    _routes_table(routes)


def _limits_table(limits: list[LimitStatus]) -> None:
    """Each handler with flow limits: what it holds in flight, and what it holds back."""
    if not limits:
        return
    table(
        "flow limits (held back: ready messages the limits keep waiting now)",
        [
            Column("queue", key=True),
            Column("handler", key=True, wrap=True),
            Column("limits", wrap=True),
            "in flight",
            "started in window",
            "waiting",
            "held back",
        ],
        [
            [
                limit.queue,
                limit.handler,
                limit.limits,
                limit.in_flight,
                "-" if limit.started is None else limit.started,
                limit.waiting,
                limit.held_back,
            ]
            for limit in limits
        ],
    )


def _oldest_ready(q: QueueStatus) -> str:
    """The age of the oldest claimable row; "blocked" when the ready rows are all members
    parked behind a sequence's head in F or R (the blocked table below names it)."""
    return "blocked" if q.ready_blocked else age_text(q.oldest_ready_seconds)


def _created_by_send(queues: list[QueueStatus]) -> None:
    """Queues a send created and no endpoint has started on (a typo?), with their sender."""
    marked = [q for q in queues if q.created_by_send]
    if not marked:
        return
    table(
        "queues created by a send (a typo? see docs/operations.md)",
        [Column("queue", key=True), Column("note", wrap=True)],
        [[q.queue, q.created_by_send_note] for q in marked],
    )


def _routes_table(routes: list[RouteStatus]) -> None:
    """Every database of the routes, and what waits in the outbox for each of its queues."""
    if not routes:
        return
    table(
        "routes: queues in other databases, through the outbox (lag = oldest waiting)",
        [
            Column("database", key=True),
            Column("reachable", wrap=True),
            Column("queue", key=True),
            "waiting",
            Column("lag", align="right"),
        ],
        [
            [
                r.database or "(no route here)",
                "-" if r.reachable is None else ("yes" if r.reachable else f"no: {r.error}"),
                q.queue,
                q.waiting,
                age_text(q.oldest_seconds),
            ]
            for r in routes
            for q in r.queues
        ],
    )
