"""The figures: from rows to the report's tables, in Spark, with no reading or writing.

Definitions:

* queue latency = ``last_processed - retry_time`` (waiting since ready), and
  end-to-end latency = ``last_processed - insert_time``, both over processed
  rows only; rows missing either timestamp count but have no latency;
* a row's time is ``coalesce(last_processed, retry_time, insert_time)``: it
  places the row in a window and is what ``--since`` (inclusive) and
  ``--until`` (exclusive) filter on; windows are UTC;
* percentiles come from ``percentile_approx`` with accuracy A: the value
  reported for percentile p of n values is one of those values whose rank is
  within ceil(n/A) + 1 of the rank p*(n-1)+1 that ``percentile_cont`` uses.
"""

from __future__ import annotations

import os
import time
from typing import Any

try:  # a module of the nmbus package
    from nmbus.stats.options import WINDOWS, Options
except ImportError:  # a plain file under spark-submit: the siblings are on sys.path
    from options import WINDOWS, Options  # type: ignore[no-redef]

PERCENTILES = (0.5, 0.95, 0.99)
NO_LABEL = "(none)"
NO_ERROR = "(no error recorded)"


def prepare(df: Any, window: str) -> Any:
    """Add the row's time, window and latencies (microseconds, processed rows only)."""
    from pyspark.sql import functions as F

    event = F.coalesce("last_processed", "retry_time", "insert_time")
    processed = F.col("subqueue") == "X"
    micros = F.unix_micros
    qlat = F.when(processed, micros("last_processed") - micros("retry_time"))
    e2e = F.when(processed, micros("last_processed") - micros("insert_time"))
    error = F.when(F.col("error").isNotNull() & (F.col("error") != ""), F.col("error"))
    error = F.when(error.isNull() & (F.col("subqueue") == "F"), F.lit(NO_ERROR)).otherwise(error)
    return df.select(
        "queue",
        "id",
        "subqueue",
        F.coalesce("label", F.lit(NO_LABEL)).alias("label"),
        F.col("retry_count").cast("int").alias("retry_count"),
        event.alias("event_time"),
        F.date_trunc(window, event).alias("window_start"),
        qlat.alias("qlat"),
        e2e.alias("e2e"),
        error.alias("error"),
    )


GROUPING = {
    # grouping_id(queue, label, window_start): a set bit means "all of them"
    0: "windows",
    2: "queue_windows",
    1: "labels",
    3: "queues",
    7: "overall",
}


def aggregate(spark: Any, rows: Any, opts: Options) -> Any:
    """Counts, latency mean/percentiles/max at five levels, in one pass."""
    view = f"nmbus_stats_rows_{os.getpid()}_{int(time.time() * 1000)}"
    rows.createOrReplaceTempView(view)
    pct = ", ".join(str(p) for p in PERCENTILES)
    lat = []
    for name in ("qlat", "e2e"):
        prefix = "queue_latency" if name == "qlat" else "e2e_latency"
        lat.append(
            f"avg({name}) / 1000D AS {prefix}_mean_ms, "
            f"percentile_approx({name}, array({pct}), {opts.accuracy}) AS {prefix}_pct, "
            f"max({name}) / 1000D AS {prefix}_max_ms"
        )
    return spark.sql(
        f"""
            SELECT grouping_id(queue, label, window_start) AS gid,
                   queue, label, window_start,
                   count_if(subqueue = 'X') AS processed,
                   count_if(subqueue = 'F') AS failed,
                   count(qlat) AS queue_latency_rows,
                   count(e2e) AS e2e_latency_rows,
                   {", ".join(lat)},
                   min(event_time) AS first_time,
                   max(event_time) AS last_time
            FROM {view}
            GROUP BY GROUPING SETS (
                (queue, label, window_start), (queue, window_start),
                (queue, label), (queue), ())
            """
    )


def finish_level(df: Any, level: str, opts: Options) -> Any:
    """One level of the aggregate with rates, throughput and flat percentile columns."""
    from pyspark.sql import functions as F

    gid = {v: k for k, v in GROUPING.items()}[level]
    df = df.where(F.col("gid") == gid)
    seconds = WINDOWS[opts.window]
    total = F.col("processed") + F.col("failed")
    cols: list[Any] = []
    if level in ("windows", "labels", "queues", "queue_windows"):
        cols.append("queue")
    if level in ("windows", "labels"):
        cols.append("label")
    if level in ("windows", "queue_windows"):
        cols += [
            "window_start",
            (F.col("window_start") + F.expr(f"INTERVAL {seconds} SECONDS")).alias("window_end"),
        ]
        throughput = F.col("processed") / F.lit(float(seconds))
    else:
        start = F.lit(opts.since) if opts.since else F.col("first_time")
        end = F.lit(opts.until) if opts.until else F.col("last_time")
        span = (F.unix_micros(end) - F.unix_micros(start)) / 1e6
        throughput = F.when(span > 0, F.col("processed") / span)
    cols += [
        "processed",
        "failed",
        total.alias("total"),
        F.when(total > 0, F.col("failed") / total).alias("failure_rate"),
        throughput.alias("throughput_per_s"),
    ]
    for prefix in ("queue_latency", "e2e_latency"):
        cols.append(f"{prefix}_rows")
        cols.append(f"{prefix}_mean_ms")
        for i, p in enumerate(PERCENTILES):
            cols.append(
                (F.col(f"{prefix}_pct")[i] / 1000.0).alias(f"{prefix}_p{round(p * 100)}_ms")
            )
        cols.append(f"{prefix}_max_ms")
    cols += ["first_time", "last_time"]
    order = [c for c in ("queue", "label", "window_start") if any(c is x for x in cols)]
    return df.select(*cols).orderBy(*order) if order else df.select(*cols)


def retries(rows: Any) -> Any:
    """How many attempts messages took, by queue, type and outcome."""
    from pyspark.sql import functions as F

    return (
        rows.groupBy("queue", "label", "subqueue", "retry_count")
        .agg(F.count(F.lit(1)).alias("messages"))
        .withColumn("outcome", F.when(F.col("subqueue") == "X", "processed").otherwise("failed"))
        .drop("subqueue")
        .select("queue", "label", "outcome", "retry_count", "messages")
        .orderBy("queue", "label", "outcome", "retry_count")
    )


def errors(rows: Any) -> Any:
    """Errors by first line: failed rows, processed rows that failed before, an example id."""
    from pyspark.sql import functions as F

    failed = F.col("subqueue") == "F"
    return (
        rows.where(F.col("error").isNotNull())
        .groupBy("queue", "label", "error")
        .agg(
            F.count_if(failed).alias("failed"),
            F.count_if(~failed).alias("recovered"),
            F.coalesce(F.min(F.when(failed, F.col("id"))), F.min("id")).alias("example_id"),
            F.min("event_time").alias("first_time"),
            F.max("event_time").alias("last_time"),
        )
        .orderBy(F.desc("failed"), F.desc("recovered"), "queue", "label", "error")
    )


def figures(agg: Any, rows: Any, opts: Options) -> dict[str, Any]:
    """Every table of the report: the five levels of ``agg``, then retries and errors."""
    tables = {level: finish_level(agg, level, opts) for level in GROUPING.values()}
    tables["retries"] = retries(rows)
    tables["errors"] = errors(rows)
    return tables
