"""nmbus statistics job: latency and failure figures of every queue, on Spark.

Reads the processed (``X``) and failed (``F``) rows of every queue table over
JDBC, split into ranges of ``id`` so every executor reads its own slice (or,
on a local master, exported by the driver with COPY into Parquet), plus
the Parquet files retention archived (``<archive>/queue=<q>/day=<d>/*.parquet``),
counting each (queue, id) once. It writes:

* ``parquet/<table>``: windows, queue_windows, labels, queues, retries, errors;
* ``summary.json``: the same figures for scripts;
* ``report.html``: one self-contained page with charts.

Run it on any master, its package zipped for ``--py-files``::

    python nmbus/stats/ship.py nmbus-stats.zip
    spark-submit --jars /usr/share/java/postgresql.jar --py-files nmbus-stats.zip \\
        nmbus/stats/submit.py --dsn postgresql://user@db:5432/app --out hdfs:///reports/nmbus

(``submit.py`` runs this module's ``main``; ``python -m nmbus.stats.job`` does too.)
This module holds ``run`` and the command line. The work is done by the other
modules of the package, one concern each, which import only pyspark, the
standard library and each other (relatively: never the rest of nmbus), so the
package runs where nmbus is not installed:

* ``options.py``: ``Options``, their checks, ``StatsError``;
* ``jdbc.py``: DSN to JDBC settings, the driver jar, reachability, quoting;
* ``session.py``: the SparkSession of a local run, and the Java it runs on;
* ``source.py``: reading queue tables (partitioned by id) and the archive;
* ``pgcopy.py``: the non-JDBC reader (COPY into Parquet, local masters);
* ``aggregate.py``: the figures, and what they mean;
* ``outputs.py``: Parquet, ``summary.json``, ``report.html`` (``report_html.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

from . import outputs, pgcopy, source
from .aggregate import aggregate, choose_window, figures, prepare, time_span
from .jdbc import check_driver, check_reachable, find_jdbc_jar, jdbc_from_dsn
from .options import (
    AUTO_WINDOW,
    DEFAULT_ACCURACY,
    SOURCES,
    WINDOWS,
    Options,
    StatsError,
    parse_time,
)
from .outputs import Result
from .session import (
    active_session,
    build_session,
    command_line_session,
    stop_session,
)

# What nmbus report, the demo and the benchmark use through this module.
__all__ = [
    "Options",
    "Result",
    "StatsError",
    "active_session",
    "build_session",
    "check_reachable",
    "find_jdbc_jar",
    "jdbc_from_dsn",
    "main",
    "parse_time",
    "run",
    "stop_session",
]


def run(spark: Any, opts: Options) -> Result:
    """Read, compute and write everything; returns the summary."""
    opts.validate()
    started = time.perf_counter()
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    _size_shuffles(spark)
    reader = source.choose_reader(opts, spark.sparkContext.master)
    jdbc = jdbc_from_dsn(opts.dsn) if opts.dsn else None
    staged = None
    try:
        if jdbc is None:  # the archive alone, no database
            queues: list[str] = []
            rows = source.read_archive_only(spark, opts)
        elif reader == "copy":
            check_reachable(jdbc)
            staged = pgcopy.export(opts, jdbc)
            queues = staged.queues
            rows = source.read_copied(spark, opts, staged.files, queues)
        else:
            check_reachable(jdbc)
            check_driver(spark)
            queues = source.list_queues(spark, jdbc, opts)
            rows = source.read_rows(spark, jdbc, opts, queues)
        return _compute(spark, opts, jdbc, reader, queues, rows, started)
    finally:
        if staged is not None:
            staged.remove()


def _compute(
    spark: Any,
    opts: Options,
    jdbc: Any,
    reader: str,
    queues: list[str],
    rows: Any,
    started: float,
) -> Result:
    from pyspark import StorageLevel

    tables: dict[str, Any] = {}
    written: dict[str, str] = {}
    auto = opts.window == AUTO_WINDOW
    if rows is None:
        opts = dataclasses.replace(opts, window="hour" if auto else opts.window)
        summary = outputs.summary(tables, opts, queues, jdbc)
    else:
        # Read once (the first job below), then every figure from memory.
        rows = prepare(rows).persist(StorageLevel.MEMORY_AND_DISK)
        cached = [rows]
        try:
            if auto:
                opts = dataclasses.replace(opts, window=choose_window(*time_span(rows)))
            agg = aggregate(spark, rows, opts).persist(StorageLevel.MEMORY_AND_DISK)
            tables = figures(agg, rows, opts)
            # The small tables are computed once, by the summary's one collect, and
            # written from memory after it.
            for name in ("retries", "errors"):
                tables[name] = tables[name].persist(StorageLevel.MEMORY_AND_DISK)
            cached += [agg, tables["retries"], tables["errors"]]
            summary = outputs.summary(tables, opts, queues, jdbc)
            written = outputs.write_tables(tables, opts)
        finally:
            for df in reversed(cached):
                df.unpersist()
        if auto:
            summary["window_chosen"] = "from the data's time span"

    if opts.write_table and tables:
        outputs.write_back(tables, jdbc, opts)
    summary["source"]["reader"] = reader
    elapsed = time.perf_counter() - started
    row_count = int(summary["overall"]["total"])
    summary["run"] = {
        "seconds": round(elapsed, 3),
        "rows": row_count,
        "rows_per_second": round(row_count / elapsed, 1) if elapsed > 0 else None,
        "spark_master": spark.sparkContext.master,
        "spark_version": spark.version,
        "java": _java(spark),
    }
    outputs.write_report(spark, summary, written, opts.out)
    return Result(summary, opts.out, elapsed, row_count, written)


def _size_shuffles(spark: Any) -> None:
    """Shuffle tasks: twice the cores, unless the submitter chose (Spark's default is 200).

    The job's shuffles carry partial aggregates, so they are small whatever the
    rows; on a two-core standalone cluster 200 tasks per shuffle stage made
    2,154 tasks of a run and most of its time (see docs/statistics.md).
    """
    sc = spark.sparkContext
    if sc.getConf().contains("spark.sql.shuffle.partitions"):
        return
    spark.conf.set("spark.sql.shuffle.partitions", str(max(4, 2 * sc.defaultParallelism)))


def _java(spark: Any) -> dict[str, str] | None:
    """The driver JVM's version and home (None under Spark Connect)."""
    jvm = getattr(spark, "_jvm", None)
    if jvm is None:
        return None
    system = jvm.java.lang.System
    return {"version": system.getProperty("java.version"), "home": system.getProperty("java.home")}


# --------------------------------------------------------------------------- command line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nmbus-stats",
        description="Latency and failure statistics of nmbus queues, on Spark.",
    )
    p.add_argument("--dsn", default=os.environ.get("NMBUS_DSN"), help="postgresql://... DSN")
    p.add_argument("--out", default="nmbus-report", help="output directory (any Hadoop path)")
    p.add_argument("--schema", default=os.environ.get("NMBUS_SCHEMA_NAME", "nmbus"))
    p.add_argument(
        "--window",
        default=AUTO_WINDOW,
        choices=[AUTO_WINDOW, *sorted(WINDOWS)],
        help="time window of the series; auto: from the data's time span",
    )
    p.add_argument("--since", type=parse_time, help="ISO time or span back (2h, 7d); inclusive")
    p.add_argument("--until", type=parse_time, help="ISO time or span back; exclusive")
    p.add_argument("--partitions", type=int, default=8, help="JDBC partitions per queue (max)")
    p.add_argument("--archive-dir", help="retention's Parquet archive (queue=/day= folders)")
    p.add_argument("--queue", action="append", default=[], help="only this queue (repeatable)")
    p.add_argument("--accuracy", type=int, default=DEFAULT_ACCURACY, help="percentile accuracy")
    p.add_argument("--top-errors", type=int, default=10)
    p.add_argument("--write-table", action="store_true", help="also write stats_* tables")
    p.add_argument("--fetch-size", type=int, default=10_000, help="JDBC rows per round trip")
    p.add_argument(
        "--source",
        default="auto",
        choices=SOURCES,
        help="how rows reach Spark: jdbc (partitioned reads), copy (COPY into Parquet on "
        "the driver; no JDBC jar), auto (copy on a local master, else jdbc)",
    )
    p.add_argument("--copy-dir", help="where --source copy stages its Parquet files")
    p.add_argument("--master", help="Spark master when not started by spark-submit")
    p.add_argument("--jdbc-jar", help="PostgreSQL JDBC jar when not passed with --jars")
    return p


def options_from_args(args: argparse.Namespace) -> Options:
    if not args.dsn and not args.archive_dir:
        raise StatsError("no database: pass --dsn postgresql://... or set NMBUS_DSN")
    return Options(
        dsn=args.dsn,
        out=args.out,
        schema=args.schema,
        window=args.window,
        since=args.since,
        until=args.until,
        partitions=args.partitions,
        archive_dir=args.archive_dir,
        queues=args.queue,
        accuracy=args.accuracy,
        top_errors=args.top_errors,
        write_table=args.write_table,
        fetch_size=args.fetch_size,
        source=args.source,
        copy_dir=args.copy_dir,
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        opts = options_from_args(args)
        opts.validate()
        if opts.dsn:
            check_reachable(jdbc_from_dsn(opts.dsn))
        # The archive alone needs no JDBC; else a cluster does, and a local master not.
        need_jdbc = (opts.source == "jdbc" or opts.write_table or None) if opts.dsn else False
        spark = command_line_session(args.master, args.jdbc_jar, need_jdbc)
        try:
            result = run(spark, opts)
        finally:
            stop_session(spark)
    except StatsError as exc:
        print(f"nmbus-stats: error: {exc}", file=sys.stderr)
        return 2
    o = result.summary["overall"]
    print(
        f"nmbus-stats: {o['processed']} processed, {o['failed']} failed in "
        f"{len(result.summary['queues'])} queue(s); {result.seconds:.1f}s; "
        f"report {result.html_path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
