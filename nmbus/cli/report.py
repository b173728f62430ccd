"""``nmbus report``: run the Spark statistics job on this machine and write the report."""

from __future__ import annotations

import importlib
import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from nmbus.cli import app
from nmbus.cli._common import CommandError


class Window(StrEnum):
    second = "second"
    minute = "minute"
    hour = "hour"
    day = "day"


def _job() -> Any:
    # The job imports pyspark only inside its functions: ask for it here, before
    # anything starts, so a missing pyspark is one line and not a traceback.
    try:
        importlib.import_module("pyspark")
        return importlib.import_module("nmbus.stats.job")
    except ImportError as exc:
        raise CommandError(
            f"the statistics job needs pyspark ({exc}): pip install 'nmbus[spark]'", code=2
        ) from exc


@app.command()
def report(
    dsn: Annotated[
        str | None, typer.Option(envvar="NMBUS_DSN", help="PostgreSQL DSN (postgresql://...)")
    ] = None,
    out: Annotated[Path, typer.Option(help="output directory")] = Path("nmbus-report"),
    schema: Annotated[str, typer.Option(envvar="NMBUS_SCHEMA_NAME", help="schema")] = "nmbus",
    window: Annotated[Window, typer.Option(help="time window of the series")] = Window.hour,
    since: Annotated[
        str | None, typer.Option(help="from this time (ISO 8601, or a span back: 2h, 7d)")
    ] = None,
    until: Annotated[str | None, typer.Option(help="up to this time, exclusive")] = None,
    queue: Annotated[list[str] | None, typer.Option(help="only this queue (repeatable)")] = None,
    archive_dir: Annotated[
        str | None, typer.Option(help="retention's Parquet archive (queue=/day= folders)")
    ] = None,
    partitions: Annotated[int, typer.Option(help="JDBC partitions per queue, at most")] = 8,
    accuracy: Annotated[int, typer.Option(help="percentile accuracy (rank error n/A)")] = 10_000,
    top_errors: Annotated[int, typer.Option(help="errors listed in the summary")] = 10,
    write_table: Annotated[
        bool, typer.Option(help="also write <schema>.stats_windows / stats_queues")
    ] = False,
    master: Annotated[str, typer.Option(help="Spark master")] = "local[*]",
    jdbc_jar: Annotated[
        str | None, typer.Option(envvar="NMBUS_JDBC_JAR", help="PostgreSQL JDBC jar")
    ] = None,
    driver_memory: Annotated[str, typer.Option(help="Spark driver memory")] = "2g",
    as_json: Annotated[bool, typer.Option("--json", help="print the summary as JSON")] = False,
) -> None:
    """Latency and failure report of every queue: Parquet, summary.json and report.html."""
    job = _job()
    if not dsn:
        raise CommandError("no database: pass --dsn or set NMBUS_DSN", code=2)
    spark = borrowed = None
    try:
        opts = job.Options(
            dsn=dsn,
            out=str(out),
            schema=schema,
            window=window.value,
            since=job.parse_time(since) if since else None,
            until=job.parse_time(until) if until else None,
            partitions=partitions,
            archive_dir=archive_dir,
            queues=list(queue or []),
            accuracy=accuracy,
            top_errors=top_errors,
            write_table=write_table,
        )
        opts.validate()
        # Fail before the JVM starts when the server is not there at all.
        job.check_reachable(job.jdbc_from_dsn(dsn))
        if not as_json:
            typer.echo(f"starting Spark ({master}) ...", err=True)
        borrowed = job.active_session()
        spark = borrowed or job.build_session(master, jdbc_jar, driver_memory)
        result = job.run(spark, opts)
    except job.StatsError as exc:
        raise CommandError(str(exc), code=2) from exc
    finally:
        if spark is not None and borrowed is None:
            spark.stop()
    if as_json:
        typer.echo(json.dumps(result.summary, indent=2))
        return
    _print_summary(result)


def _print_summary(result: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    summary = result.summary
    table = Table(title=f"nmbus queues, by {summary['window']}")
    for column in ("queue", "processed", "failed", "failure rate", "p50", "p95", "p99", "max"):
        table.add_column(column, justify="left" if column == "queue" else "right")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:,.1f} ms"

    for q in [*summary["queues"], {"queue": "all", **summary["overall"]}]:
        lat = q["queue_latency_ms"]
        rate = q["failure_rate"]
        table.add_row(
            q["queue"],
            f"{q['processed']:,}",
            f"{q['failed']:,}",
            "-" if rate is None else f"{rate:.2%}",
            ms(lat["p50"]),
            ms(lat["p95"]),
            ms(lat["p99"]),
            ms(lat["max"]),
        )
    console = Console()
    console.print(table)
    console.print(
        f"{result.rows:,} rows in {result.seconds:.1f}s; report: {result.html_path}, "
        f"summary: {result.json_path}, tables: {result.out}/parquet/"
    )
