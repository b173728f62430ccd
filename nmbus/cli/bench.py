"""``nmbus bench``: throughput and latency figures against your own database.

Loaded only when it runs (see NmbusGroup.lazy).
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import typer
from rich.console import Console

from nmbus.cli._table import Column, Grid
from nmbus.settings import Settings

command = typer.Typer(add_completion=False)

MODES_HELP = (
    "ceiling, peers, drain, transactional, latency, fanout, scaling, xrows, saga, delivery, "
    "routed, reply, retention, flow, burst, or all (every one but scaling, xrows, saga, "
    "delivery, routed, reply, retention, flow and burst)"
)


@command.command()
def bench(
    modes: Annotated[list[str] | None, typer.Argument(help=MODES_HELP, show_default=False)] = None,
    dsn: Annotated[
        str | None, typer.Option(envvar="NMBUS_DSN", help="PostgreSQL DSN", show_default=False)
    ] = None,
    messages: Annotated[
        int,
        typer.Option(
            "--messages",
            "-n",
            min=1,
            help="messages pre-loaded and drained per run (every mode but latency and fanout)",
        ),
    ] = 50_000,
    batch_size: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=10_000,
            help="rows a worker claims in one statement (unset: each loop adapts it, as a "
            "worker's default does; the ceilings claim 500)",
        ),
    ] = None,
    concurrency: Annotated[
        int,
        typer.Option(
            "--concurrency",
            "--loops",
            min=1,
            help="worker loops (per process; default: a worker's default) and ceiling connections",
        ),
    ] = Settings.model_fields["concurrency"].default,
    processes: Annotated[
        int, typer.Option(min=1, help="saga: worker processes of the contended run")
    ] = 1,
    sagas: Annotated[int, typer.Option(min=1, help="saga: sagas of the contended run")] = 3,
    baseline_messages: Annotated[
        int, typer.Option(min=1, help="messages of the per-message-transaction loop")
    ] = 5_000,
    rate: Annotated[float, typer.Option(min=1.0, help="latency: messages per second")] = 200.0,
    seconds: Annotated[float, typer.Option(min=0.1, help="latency: measured seconds")] = 10.0,
    warmup: Annotated[float, typer.Option(min=0.0, help="latency: seconds not counted")] = 1.0,
    subscribers: Annotated[int, typer.Option(min=1, help="fanout: subscriber queues")] = 3,
    publishers: Annotated[int, typer.Option(min=1, help="fanout: concurrent publishers")] = 8,
    fanout_messages: Annotated[int, typer.Option(min=1, help="fanout: messages")] = 10_000,
    fanout_batch: Annotated[
        int, typer.Option(min=1, help="fanout: messages per publish_many call")
    ] = 500,
    x_rows: Annotated[
        int, typer.Option(min=0, help="xrows, retention: processed rows pre-loaded")
    ] = (5_000_000),
    segments: Annotated[
        int, typer.Option(min=1, max=10_000, help="xrows, retention: segments the X rows fill")
    ] = 30,
    sequences: Annotated[int, typer.Option(min=1, help="delivery: sequences")] = 50,
    sequence_members: Annotated[
        int, typer.Option(min=1, help="delivery: members of each sequence")
    ] = 1_000,
    repeat: Annotated[int, typer.Option(min=1, help="runs per mode; figures are medians")] = 1,
    peer: Annotated[
        list[str] | None,
        typer.Option(
            help="peers: a peer to measure, pgqueuer or graphile-worker (repeatable; unset: both)",
            show_default=False,
        ),
    ] = None,
    unconfigured_logging: Annotated[
        bool,
        typer.Option(
            "--unconfigured-logging",
            help="leave structlog unconfigured, as an application that never set it up "
            "(a new user's default)",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Measure nmbus on a scratch schema it creates and drops; print figures and settings."""
    from nmbus.tools.bench import ALL_MODES, MODES, PEERS, BenchOptions, run

    if not dsn:
        raise typer.BadParameter("give --dsn or set NMBUS_DSN", param_hint="--dsn")
    chosen: list[str] = []
    for mode in modes or ["all"]:
        for m in ALL_MODES if mode == "all" else (mode,):
            if m not in MODES:
                raise typer.BadParameter(f"unknown mode {m!r}; choose from {MODES_HELP}")
            if m not in chosen:
                chosen.append(m)
    peers = tuple(dict.fromkeys(peer or PEERS))
    for name in peers:
        if name not in PEERS:
            raise typer.BadParameter(
                f"unknown peer {name!r}; choose from {', '.join(PEERS)}", param_hint="--peer"
            )
    # Logging is the root's (warnings and errors unless --log-level says otherwise):
    # the figures are about a worker whose debug logging is off.
    options = BenchOptions(
        dsn=dsn,
        messages=messages,
        batch_size=batch_size,
        concurrency=concurrency,
        baseline_messages=baseline_messages,
        rate=rate,
        seconds=seconds,
        warmup=warmup,
        subscribers=subscribers,
        publishers=publishers,
        fanout_messages=fanout_messages,
        fanout_batch=fanout_batch,
        x_rows=x_rows,
        segments=segments,
        sequences=sequences,
        sequence_members=sequence_members,
        repeat=repeat,
        processes=processes,
        sagas=sagas,
        peers=peers,
    )
    err = Console(stderr=True)

    def progress(text: str) -> None:
        if not as_json:
            err.print(f"[dim]{text}...[/dim]")

    if unconfigured_logging:
        import structlog

        structlog.reset_defaults()
    results = asyncio.run(run(chosen, options, progress))
    if as_json:
        typer.echo(json.dumps([r.as_dict() for r in results], indent=2, default=str))
        return
    console = Console()
    console.print(
        Grid(
            "nmbus bench",
            [
                Column("mode", key=True),
                Column("figure", key=True),
                Column("median", align="right"),
                "unit",
                Column("runs", wrap=True, min_width=12),
            ],
            [
                [
                    result.mode,
                    name,
                    _fmt(value),
                    result.units[name],
                    ", ".join(_fmt(v) for v in result.runs[name]),
                ]
                for result in results
                for name, value in result.figures.items()
            ],
        )
    )
    console.print(
        Grid(
            "settings",
            [Column("mode", key=True), Column("settings", wrap=True)],
            [
                [result.mode, ", ".join(f"{k}={v}" for k, v in result.settings.items())]
                for result in results
            ],
        )
    )
    for result in results:
        for note in result.notes:
            typer.echo(note)


def _fmt(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}"
