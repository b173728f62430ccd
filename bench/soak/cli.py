"""``python -m bench.soak``: the kill soak (:mod:`bench.soak`) from the command line."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from nmbus.cli._common import LogFormat, LogLevel, configure_logging
from nmbus.cli._group import NmbusCommand
from nmbus.cli._table import Column, Grid

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command(cls=NmbusCommand)
def soak(
    messages: Annotated[int, typer.Option(help="messages to send")] = 20_000,
    workers: Annotated[int, typer.Option(help="worker processes")] = 2,
    kill_every: Annotated[float, typer.Option(help="SIGKILL a worker about every N s")] = 3.0,
    fail_rate: Annotated[float, typer.Option(help="share of handler runs that fail")] = 0.1,
    sleep_rate: Annotated[float, typer.Option(help="share of handler runs that sleep")] = 0.01,
    sleep_max: Annotated[float, typer.Option(help="longest handler sleep, seconds")] = 0.2,
    lease: Annotated[float, typer.Option(help="lease (visibility timeout), seconds")] = 2.0,
    batch_size: Annotated[int, typer.Option(help="messages per claim")] = 50,
    concurrency: Annotated[int, typer.Option(help="worker loops per process")] = 2,
    poison: Annotated[
        int, typer.Option(help="messages whose handler SIGKILLs its worker every time")
    ] = 0,
    schema: Annotated[str, typer.Option(help="schema the soak owns (dropped first!)")] = (
        "nmbus_soak"
    ),
    timeout: Annotated[float, typer.Option(help="give up after N seconds")] = 3600.0,
    dsn: Annotated[str | None, typer.Option(envvar="NMBUS_DSN", help="PostgreSQL DSN")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Kill soak: flaky handlers, a worker SIGKILLed every few seconds; verify nothing is lost.

    Drops and recreates the schema --schema (default nmbus_soak) in the database.
    Exits with status 1 when any guarantee was broken.
    """
    from bench.soak import run_soak
    from nmbus.settings import Settings

    # Warnings and errors to stderr, as nmbus's root command leaves them.
    configure_logging(LogLevel.warning, LogFormat.console)
    settings = Settings(dsn=dsn) if dsn else Settings()
    if not settings.dsn:
        raise typer.BadParameter("give --dsn or set NMBUS_DSN", param_hint="--dsn")
    console = Console(stderr=True)
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=as_json,
    ) as bar:
        task = bar.add_task("soak", total=messages)
        report = asyncio.run(
            run_soak(
                settings.dsn,
                messages,
                workers=workers,
                kill_every=kill_every,
                fail_rate=fail_rate,
                sleep_rate=sleep_rate,
                sleep_max=sleep_max,
                lease=lease,
                batch_size=batch_size,
                concurrency=concurrency,
                poison=poison,
                schema=schema,
                timeout=timeout,
                progress=lambda done, total: bar.update(task, completed=done),
            )
        )
    data = report.as_dict()
    if as_json:
        typer.echo(json.dumps(data))
    else:
        Console().print(
            Grid(
                "nmbus kill soak",
                ["figure", Column("value", align="right")],
                [
                    [key, f"{value:.1f}" if isinstance(value, float) else str(value)]
                    for key, value in data.items()
                    if key != "killed_pids"
                ],
            )
        )
    if not report.ok:
        raise typer.Exit(1)
