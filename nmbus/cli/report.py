"""``nmbus report``: run the Spark statistics job on this machine and write the report."""

from __future__ import annotations

import importlib
import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from nmbus.cli import app
from nmbus.cli._common import CommandError, operate, settings
from nmbus.errors import NmbusError, QueueNotFound
from nmbus.ops.admin import Admin
from nmbus.stats.progress import Progress, jvm_output_to


class Source(StrEnum):
    auto = "auto"
    jdbc = "jdbc"
    copy = "copy"


class Window(StrEnum):
    auto = "auto"
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


def _check_database(dsn: str, schema: str, queues: list[str]) -> int | None:
    """One connection: the database and its schema exist (exit 2, as the job's errors),
    and about how many rows the queue tables hold (None: a queue asked for is not there)."""

    async def look(admin: Admin) -> int | None:
        try:
            return await admin.rows_estimate(queues or None)
        except QueueNotFound:
            return None  # the job says which, in its own words

    try:
        return operate(settings(dsn, schema), look)
    except (CommandError, NmbusError) as exc:
        raise CommandError(str(exc), code=2) from exc


def _rows_in_archive(archive_dir: str) -> int | None:
    """The rows of a local archive, from its Parquet files' footers; None elsewhere.

    Advice only (it chooses how the driver compiles): any trouble reading it
    answers None, which is the choice for a big run.
    """
    root = Path(archive_dir.removeprefix("file://"))
    if "://" in archive_dir.removeprefix("file://"):
        return None
    try:
        import pyarrow.parquet as pq

        return sum(int(pq.ParquetFile(p).metadata.num_rows) for p in root.rglob("*.parquet"))
    except Exception:
        return None


@app.command()
def report(
    dsn: Annotated[
        str | None, typer.Option(envvar="NMBUS_DSN", help="PostgreSQL DSN (postgresql://...)")
    ] = None,
    out: Annotated[Path, typer.Option(help="output directory")] = Path("nmbus-report"),
    schema: Annotated[str, typer.Option(envvar="NMBUS_SCHEMA_NAME", help="schema")] = "nmbus",
    window: Annotated[
        Window, typer.Option(help="time window of the series; auto: from the data's time span")
    ] = Window.auto,
    since: Annotated[
        str | None, typer.Option(help="from this time (ISO 8601, or a span back: 2h, 7d)")
    ] = None,
    until: Annotated[str | None, typer.Option(help="up to this time, exclusive")] = None,
    queue: Annotated[list[str] | None, typer.Option(help="only this queue (repeatable)")] = None,
    archive_dir: Annotated[
        str | None, typer.Option(help="retention's Parquet archive (queue=/day= folders)")
    ] = None,
    partitions: Annotated[int, typer.Option(help="JDBC partitions per queue, at most")] = 8,
    accuracy: Annotated[
        int,
        typer.Option(
            metavar="A",
            help="percentile accuracy, 100 to 10000000: in a group of n messages, a "
            "percentile is at most ceil(n/A) + 1 ranks from the exact one",
        ),
    ] = 10_000,
    top_errors: Annotated[int, typer.Option(help="errors listed in the summary")] = 10,
    write_table: Annotated[
        bool,
        typer.Option(
            "--write-table", help="also write the tables stats_windows and stats_queues of --schema"
        ),
    ] = False,
    source: Annotated[
        Source,
        typer.Option(
            help="how rows reach Spark: jdbc (partitioned reads by id; needs the JDBC jar), "
            "copy (exported with COPY into Parquet on this machine; no jar), "
            "auto (copy on a local master, else jdbc)"
        ),
    ] = Source.auto,
    master: Annotated[str, typer.Option(help="Spark master")] = "local[*]",
    jdbc_jar: Annotated[
        str | None, typer.Option(envvar="NMBUS_JDBC_JAR", help="PostgreSQL JDBC jar")
    ] = None,
    driver_memory: Annotated[str, typer.Option(help="Spark driver memory")] = "2g",
    conf: Annotated[
        list[str] | None,
        typer.Option(help="a Spark setting KEY=VALUE, as spark-submit's --conf (repeatable)"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the summary as JSON")] = False,
) -> None:
    """Latency and failure report of every queue: Parquet, summary.json and report.html."""
    job = _job()
    if not dsn and not archive_dir:
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
            source=source.value,
        )
        opts.validate()
        # Fail before the JVM starts when the server is not there at all, or the
        # database or its schema does not exist.
        # What the run will read decides how its driver compiles (session.py, DRIVER_JIT).
        expected: int | None = 0
        if dsn:
            job.check_reachable(job.jdbc_from_dsn(dsn))
            if dsn.startswith(("postgresql:", "postgres:")):
                expected = _check_database(dsn, schema, list(queue or []))
            else:
                expected = None
        if archive_dir and expected is not None:
            in_archive = _rows_in_archive(archive_dir)
            expected = None if in_archive is None else expected + in_archive
        extra: dict[str, str] = {}
        for item in conf or []:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise CommandError(f"--conf takes KEY=VALUE, not {item!r}", code=2)
            extra[key.strip()] = value
        # The archive alone needs no JDBC; else a cluster does, and a local master not.
        need_jdbc = (source is Source.jdbc or write_table or None) if dsn else False
        borrowed = job.active_session()
        log = out / "spark.log"
        if not as_json and borrowed is None:
            typer.echo(f"starting Spark ({master}); its own log goes to {log}", err=True)
        with Progress() as progress:
            if borrowed is None:
                with jvm_output_to(str(log)):
                    spark = job.build_session(
                        master,
                        jdbc_jar,
                        driver_memory,
                        need_jdbc=need_jdbc,
                        extra_conf=extra,
                        expected_rows=expected,
                    )
            else:
                spark = borrowed
            progress.attach(spark)
            result = job.run(spark, opts)
    except job.StatsError as exc:
        raise CommandError(str(exc), code=2) from exc
    finally:
        if spark is not None and borrowed is None:
            job.stop_session(spark)
    if as_json:
        typer.echo(json.dumps(result.summary, indent=2))
        return
    _print_summary(result)


def _print_summary(result: Any) -> None:
    from rich.console import Console

    from nmbus.cli._table import Column, Grid

    summary = result.summary

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:,.1f}"

    rows = []
    for q in [*summary["queues"], {"queue": "all", **summary["overall"]}]:
        lat = q["queue_latency_ms"]
        rate = q["failure_rate"]
        rows.append(
            [
                q["queue"],
                q["processed"],
                q["failed"],
                "-" if rate is None else f"{rate:.2%}",
                *(ms(lat[p]) for p in ("p50", "p95", "p99", "max")),
            ]
        )
    latency = "latency"
    console = Console()
    console.print(
        Grid(
            f"nmbus queues, by {summary['window']} (queue latency in ms)",
            [
                Column("queue", key=True),
                "processed",
                "failed",
                Column("failure rate", align="right"),
                *(Column(f"{p} ms", align="right", group=latency) for p in ("p50", "p95", "p99")),
                Column("max ms", align="right", group=latency),
            ],
            rows,
        )
    )
    console.print(
        f"{result.rows:,} rows in {result.seconds:.1f}s; report: {result.html_path}, "
        f"summary: {result.json_path}, tables: {result.out}/parquet/",
        highlight=False,
    )
