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
  within ceil(n/A) + 1 of the rank p*(n-1)+1 that ``percentile_cont`` uses;
* errors are grouped by their first line with numbers, UUIDs and long hex
  strings masked (``mask_error``), so ``order 1234 not found`` and
  ``order 5678 not found`` are one row, ``order <n> not found``; each group
  keeps one example line and id;
* attempts are ``retry_count``, the handler runs the bus counted. A
  ``RetryLater`` is not an attempt (the bus gives the count back), so a
  message whose last recorded outcome before it finished is a deferral
  (its ``error_info`` is a ``RetryLater``) is counted as ``deferred``, and
  such a row is not an error;
* a row's version is its ``nmbus-version`` header, 1 when it has none (as
  the bus reads it), NULL for a header that holds no whole number.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .options import WINDOWS, Options

PERCENTILES = (0.5, 0.95, 0.99)
NO_LABEL = "(none)"
NO_ERROR = "(no error recorded)"

# What mask_error replaces, in order (Java regular expressions, as Spark runs them).
MASKS = (
    (r"(?i)\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", "<uuid>"),
    (r"(?i)\b0x[0-9a-f]+\b", "<hex>"),
    (r"(?i)\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{8,}\b", "<hex>"),
    (r"(?<![A-Za-z_])[0-9]+(?:\.[0-9]+)?", "<n>"),
)
# The first line of a RetryLater's error_info (dispatch.error_info: "Type: reason").
RETRY_LATER = r"^(?:[A-Za-z_][A-Za-z0-9_]*\.)*RetryLater(?::|$)"

# A span of data is drawn with at most this many windows of the chosen size.
MAX_POINTS = 300


def choose_window(first: Any, last: Any) -> str:
    """The smallest window that draws ``first`` .. ``last`` in at most MAX_POINTS points."""
    if first is None or last is None:
        return "hour"
    span = max(0.0, (last - first).total_seconds())
    for name, seconds in sorted(WINDOWS.items(), key=lambda kv: kv[1]):
        if span / seconds <= MAX_POINTS:
            return name
    return max(WINDOWS, key=lambda k: WINDOWS[k])


def mask_error(col: Any) -> Any:
    """``col`` with numbers, UUIDs and hex strings masked: what errors are grouped by."""
    from pyspark.sql import functions as F

    for pattern, replacement in MASKS:
        col = F.regexp_replace(col, pattern, replacement)
    return col


def time_span(rows: Any) -> tuple[Any, Any]:
    """(first, last) row time of prepared ``rows``: one small job."""
    from pyspark.sql import functions as F

    got = rows.agg(F.min("event_time").alias("lo"), F.max("event_time").alias("hi")).collect()[0]
    return got["lo"], got["hi"]


def prepare(df: Any, window: str | None = None) -> Any:
    """Add the row's time and latencies (microseconds, processed rows only).

    The window is chosen later (``aggregate``), once the time span is known.
    """
    from pyspark.sql import functions as F

    event = F.coalesce("last_processed", "retry_time", "insert_time")
    processed = F.col("subqueue") == "X"
    micros = F.unix_micros
    qlat = F.when(processed, micros("last_processed") - micros("retry_time"))
    e2e = F.when(processed, micros("last_processed") - micros("insert_time"))
    error = F.when(F.col("error").isNotNull() & (F.col("error") != ""), F.col("error"))
    error = F.when(error.isNull() & (F.col("subqueue") == "F"), F.lit(NO_ERROR)).otherwise(error)
    # A processed message whose last recorded outcome was a RetryLater was deferred, not failed.
    deferred = (F.col("subqueue") == "X") & F.coalesce(error.rlike(RETRY_LATER), F.lit(False))
    return df.select(
        "queue",
        "id",
        "subqueue",
        F.coalesce("label", F.lit(NO_LABEL)).alias("label"),
        F.col("retry_count").cast("int").alias("retry_count"),
        event.alias("event_time"),
        qlat.alias("qlat"),
        e2e.alias("e2e"),
        F.when(~deferred, error).alias("error"),
        deferred.alias("deferred"),
        F.col("version").cast("int").alias("version"),
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
    window = opts.window
    if window not in WINDOWS:  # never user text in SQL
        raise ValueError(f"unknown window {window!r}")
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
            FROM (SELECT *, date_trunc('{window}', event_time) AS window_start FROM {view})
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
    return df.select(*cols)


def retries(rows: Any) -> Any:
    """How many attempts messages took, by queue, type and outcome; and how many were deferred."""
    from pyspark.sql import functions as F

    return (
        rows.groupBy("queue", "label", "subqueue", "retry_count")
        .agg(
            F.count(F.lit(1)).alias("messages"),
            F.count_if(F.col("deferred")).alias("deferred"),
        )
        .withColumn("outcome", F.when(F.col("subqueue") == "X", "processed").otherwise("failed"))
        .drop("subqueue")
        .select("queue", "label", "outcome", "retry_count", "messages", "deferred")
    )


def versions(rows: Any) -> Any:
    """How many messages of each type and version were processed and failed, by queue.

    A row's version is its ``nmbus-version`` header, 1 without one; NULL for a
    header that holds no version.
    """
    from pyspark.sql import functions as F

    return (
        rows.groupBy("queue", "label", "version")
        .agg(
            F.count_if(F.col("subqueue") == "X").alias("processed"),
            F.count_if(F.col("subqueue") == "F").alias("failed"),
        )
        .select("queue", "label", "version", "processed", "failed")
    )


def errors(rows: Any) -> Any:
    """Errors by masked first line: failed rows, processed rows that failed before, an example."""
    from pyspark.sql import functions as F

    failed = F.col("subqueue") == "F"
    return (
        rows.where(F.col("error").isNotNull())
        .withColumn("pattern", mask_error(F.col("error")))
        .groupBy("queue", "label", "pattern")
        .agg(
            F.count_if(failed).alias("failed"),
            F.count_if(~failed).alias("recovered"),
            F.coalesce(F.min(F.when(failed, F.col("id"))), F.min("id")).alias("example_id"),
            F.coalesce(
                F.min_by("error", F.when(failed, F.col("id"))), F.min_by("error", "id")
            ).alias("example"),
            F.min("event_time").alias("first_time"),
            F.max("event_time").alias("last_time"),
        )
        .withColumnRenamed("pattern", "error")
        .select(
            "queue",
            "label",
            "error",
            "failed",
            "recovered",
            "example_id",
            "example",
            "first_time",
            "last_time",
        )
    )


# How each table is sorted: in its Parquet file and in the summary.
ORDER: dict[str, list[tuple[str, bool]]] = {
    "windows": [("queue", False), ("label", False), ("window_start", False)],
    "queue_windows": [("queue", False), ("window_start", False)],
    "labels": [("queue", False), ("label", False)],
    "queues": [("queue", False)],
    "overall": [],
    "retries": [("queue", False), ("label", False), ("outcome", False), ("retry_count", False)],
    "versions": [("queue", False), ("label", False), ("version", False)],
    "errors": [
        ("failed", True),
        ("recovered", True),
        ("queue", False),
        ("label", False),
        ("error", False),
    ],
}


def sort_columns(name: str) -> list[Any]:
    from pyspark.sql import functions as F

    return [F.desc(c) if desc else F.asc(c) for c, desc in ORDER[name]]


def sort_records(name: str, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` in the table's order, as Spark sorts (NULLs first ascending, last descending)."""
    for column, desc in reversed(ORDER[name]):
        present = [r for r in records if r.get(column) is not None]
        missing = [r for r in records if r.get(column) is None]
        present.sort(key=lambda r: r[column], reverse=desc)
        records = present + missing if desc else missing + present
    return records


def figures(agg: Any, rows: Any, opts: Options) -> dict[str, Any]:
    """Every table of the report: the five levels of ``agg``, then retries, versions and errors.

    They are not sorted here: ``outputs`` sorts each within its one file, and
    the summary on the driver (``ORDER``), which spares a shuffle per table.
    """
    tables = {level: finish_level(agg, level, opts) for level in GROUPING.values()}
    tables["retries"] = retries(rows)
    tables["versions"] = versions(rows)
    tables["errors"] = errors(rows)
    return tables
