"""``nmbus bench``: throughput and latency figures against your own database.

Loaded only when it runs (see NmbusGroup.lazy). The repository's ``bench/``
(not shipped: peers, soak, scenario tools) reuses its options, its choice of
modes and its tables here.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Collection, Coroutine, Sequence
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from nmbus.cli._table import Column, Grid
from nmbus.settings import Settings

if TYPE_CHECKING:
    from nmbus.bench.runner import Progress, Result

command = typer.Typer(add_completion=False)

MODES_HELP = (
    "ceiling, drain, transactional, latency, xrows, saga, or all (ceiling, drain, "
    "transactional and latency: every one but xrows, which loads millions of rows, "
    "and saga, which starts worker processes)"
)

# The options nmbus bench shares with the repository's bench/ (python -m bench).
Dsn = Annotated[
    str | None, typer.Option(envvar="NMBUS_DSN", help="PostgreSQL DSN", show_default=False)
]
BatchSize = Annotated[
    int | None,
    typer.Option(
        min=1,
        max=10_000,
        help="rows a worker claims in one statement (unset: each loop adapts it, as a "
        "worker's default does; the ceilings claim 500)",
    ),
]
Concurrency = Annotated[
    int,
    typer.Option(
        "--concurrency",
        "--loops",
        min=1,
        help="worker loops (per process; default: a worker's default) and ceiling connections",
    ),
]
Processes = Annotated[int, typer.Option(min=1, help="saga: worker processes of the contended run")]
Sagas = Annotated[int, typer.Option(min=1, help="saga: sagas of the contended run")]
BaselineMessages = Annotated[
    int, typer.Option(min=1, help="messages of the per-message-transaction loop")
]
Rate = Annotated[float, typer.Option(min=1.0, help="latency: messages per second")]
Seconds = Annotated[float, typer.Option(min=0.1, help="latency: measured seconds")]
Warmup = Annotated[float, typer.Option(min=0.0, help="latency: seconds not counted")]
Repeat = Annotated[int, typer.Option(min=1, help="runs per mode; figures are medians")]
UnconfiguredLogging = Annotated[
    bool,
    typer.Option(
        "--unconfigured-logging",
        help="leave structlog unconfigured, as an application that never set it up "
        "(a new user's default)",
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="print JSON")]
DEFAULT_CONCURRENCY: int = Settings.model_fields["concurrency"].default


@command.command()
def bench(
    modes: Annotated[list[str] | None, typer.Argument(help=MODES_HELP, show_default=False)] = None,
    dsn: Dsn = None,
    messages: Annotated[
        int,
        typer.Option(
            "--messages",
            "-n",
            min=1,
            help="messages pre-loaded and drained per run (every mode but latency)",
        ),
    ] = 50_000,
    batch_size: BatchSize = None,
    concurrency: Concurrency = DEFAULT_CONCURRENCY,
    processes: Processes = 1,
    sagas: Sagas = 3,
    baseline_messages: BaselineMessages = 5_000,
    rate: Rate = 200.0,
    seconds: Seconds = 10.0,
    warmup: Warmup = 1.0,
    x_rows: Annotated[int, typer.Option(min=0, help="xrows: processed rows pre-loaded")] = (
        5_000_000
    ),
    segments: Annotated[
        int, typer.Option(min=1, max=10_000, help="xrows: segments the X rows fill")
    ] = 30,
    repeat: Repeat = 1,
    unconfigured_logging: UnconfiguredLogging = False,
    as_json: AsJson = False,
) -> None:
    """Measure nmbus on a scratch schema it creates and drops; print figures and settings."""
    from nmbus.bench.runner import ALL_MODES, MODES, BenchOptions, run

    if not dsn:
        raise typer.BadParameter("give --dsn or set NMBUS_DSN", param_hint="--dsn")
    chosen = choose(modes, MODES, ALL_MODES, MODES_HELP)
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
        x_rows=x_rows,
        segments=segments,
        repeat=repeat,
        processes=processes,
        sagas=sagas,
    )
    measure(
        lambda progress: run(chosen, options, progress),
        title="nmbus bench",
        as_json=as_json,
        unconfigured_logging=unconfigured_logging,
    )


def choose(
    modes: Sequence[str] | None, known: Collection[str], every: Sequence[str], described: str
) -> list[str]:
    """The modes asked for, ``all`` spelled out as ``every``, each once, in the order given."""
    chosen: list[str] = []
    for mode in modes or ["all"]:
        for m in every if mode == "all" else (mode,):
            if m not in known:
                raise typer.BadParameter(f"unknown mode {m!r}; choose from {described}")
            if m not in chosen:
                chosen.append(m)
    return chosen


def measure(
    run: Callable[[Progress], Coroutine[Any, Any, list[Result]]],
    *,
    title: str,
    as_json: bool,
    unconfigured_logging: bool,
) -> None:
    """Run the bench (``run``, given a progress callback) and print its results."""
    err = Console(stderr=True)

    def progress(text: str) -> None:
        if not as_json:
            err.print(f"[dim]{text}...[/dim]")

    if unconfigured_logging:
        import structlog

        structlog.reset_defaults()
    results = asyncio.run(run(progress))
    if as_json:
        typer.echo(json.dumps([r.as_dict() for r in results], indent=2, default=str))
        return
    show(results, title)


def show(results: Sequence[Result], title: str) -> None:
    """The figures and the settings of ``results`` as two tables, then their notes."""
    console = Console()
    console.print(
        Grid(
            title,
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
