"""What a run leaves behind: Parquet tables, ``summary.json``, ``report.html``.

Also the optional write-back of two tables into the database, and ``Result``,
what ``job.run`` returns. Local paths are written on the driver's disk, any
other Hadoop path (``hdfs://``, ``s3a://`` ...) through Hadoop's file system.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from . import report_html
from .aggregate import PERCENTILES, sort_columns, sort_records
from .jdbc import Jdbc, jdbc_error, quote_ident
from .options import WINDOWS, Options


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        # pyspark hands back naive times in the local zone; astimezone reads them so.
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# Every value of a row as JSON, times to the microsecond (the session's zone is UTC).
JSON_OPTIONS = {"timestampFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX", "ignoreNullFields": "false"}


def collect_tables(tables: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The rows of every table in ``tables`` with one Spark job, in each table's order.

    Each row travels as one JSON text (doubles keep every digit, times every
    microsecond), so tables of different shapes share one query and one collect
    instead of one of each per table.
    """
    from pyspark.sql import functions as F
    from pyspark.sql.types import TimestampType

    if not tables:
        return {}
    parts, times, columns = [], {}, {}
    for name, df in tables.items():
        columns[name] = list(df.columns)
        times[name] = [f.name for f in df.schema.fields if isinstance(f.dataType, TimestampType)]
        parts.append(
            df.select(
                F.lit(name).alias("t"),
                F.to_json(F.struct(*df.columns), JSON_OPTIONS).alias("j"),
            )
        )
    union = parts[0]
    for part in parts[1:]:
        union = union.unionAll(part)
    got: dict[str, list[dict[str, Any]]] = {name: [] for name in tables}
    for row in union.collect():
        name, rec = row["t"], json.loads(row["j"])
        out = {c: rec.get(c) for c in columns[name]}
        for c in times[name]:
            if out[c] is not None:
                out[c] = datetime.fromisoformat(out[c])
        got[name].append(out)
    return {
        name: [{k: _plain(v) for k, v in r.items()} for r in sort_records(name, recs)]
        for name, recs in got.items()
    }


def _write_text(spark: Any, path: str, text: str) -> None:
    """Write on the driver's disk for local paths, through Hadoop for hdfs://, s3a:// ..."""
    if "://" not in path or path.startswith("file:"):
        local = path.removeprefix("file://").removeprefix("file:")
        os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)
        with open(local, "w", encoding="utf-8") as fh:
            fh.write(text)
        return
    jvm = spark._jvm
    hpath = jvm.org.apache.hadoop.fs.Path(path)
    fs = hpath.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    stream = fs.create(hpath, True)
    try:
        stream.write(bytearray(text.encode("utf-8")))
    finally:
        stream.close()


def _join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


ZERO = {
    "processed": 0,
    "failed": 0,
    "total": 0,
    "failure_rate": None,
    "throughput_per_s": None,
}


@dataclass
class Result:
    """What a run produced: the summary (as in summary.json) and where files went."""

    summary: dict[str, Any]
    out: str
    seconds: float
    rows: int
    tables: dict[str, str] = field(default_factory=dict)

    @property
    def html_path(self) -> str:
        return _join(self.out, "report.html")

    @property
    def json_path(self) -> str:
        return _join(self.out, "summary.json")


def write_tables(tables: dict[str, Any], opts: Options) -> dict[str, str]:
    """One sorted Parquet file per table, each written by one job.

    The figures are small (one row per group) and already computed: one file
    each, sorted within it, needs no shuffle, where a global sort takes two
    jobs (a sample of the keys, then the sort).
    """
    for name, df in tables.items():
        df = df.coalesce(1)
        if sort_columns(name):
            df = df.sortWithinPartitions(*sort_columns(name))
        df.write.mode("overwrite").parquet(_join(opts.out, "parquet", name))
    return {name: f"parquet/{name}" for name in tables}


def write_back(tables: dict[str, Any], jdbc: Jdbc, opts: Options) -> None:
    """Replace <schema>.stats_windows and <schema>.stats_queues with this run's figures."""
    for name in ("windows", "queues"):
        target = f"{quote_ident(opts.schema)}.{quote_ident('stats_' + name)}"
        try:
            (
                tables[name]
                .write.format("jdbc")
                .mode("overwrite")
                .option("url", jdbc.url)
                .option("dbtable", target)
                .option("truncate", "true")
                .options(**jdbc.properties())
                .save()
            )
        except Exception as exc:
            raise jdbc_error(exc, jdbc, f"writing {target}") from exc


def _metrics(rec: dict[str, Any]) -> dict[str, Any]:
    out = {k: rec.get(k) for k in ZERO}
    for prefix in ("queue_latency", "e2e_latency"):
        out[prefix + "_ms"] = {
            "rows": rec.get(prefix + "_rows", 0),
            "mean": rec.get(prefix + "_mean_ms"),
            **{
                f"p{round(p * 100)}": rec.get(f"{prefix}_p{round(p * 100)}_ms") for p in PERCENTILES
            },
            "max": rec.get(prefix + "_max_ms"),
        }
    out["first_time"] = rec.get("first_time")
    out["last_time"] = rec.get("last_time")
    return out


def summary(
    tables: dict[str, Any], opts: Options, queues: list[str], jdbc: Jdbc | None
) -> dict[str, Any]:
    # The per-type-and-window table can be large; it stays in Parquet (and the database).
    get = collect_tables({name: df for name, df in tables.items() if name != "windows"})
    overall = get.get("overall") or [dict(ZERO)]
    by_queue = {r["queue"]: r for r in get.get("queues", [])}
    labels: dict[str, list[dict[str, Any]]] = {}
    for r in get.get("labels", []):
        labels.setdefault(r["queue"], []).append({"label": r["label"], **_metrics(r)})
    retry_rows: dict[str, list[dict[str, Any]]] = {}
    for r in get.get("retries", []):
        retry_rows.setdefault(r["queue"], []).append(
            {k: r[k] for k in ("label", "outcome", "retry_count", "messages", "deferred")}
        )
    version_rows: dict[str, list[dict[str, Any]]] = {}
    for r in get.get("versions", []):
        version_rows.setdefault(r["queue"], []).append(
            {k: r[k] for k in ("label", "version", "processed", "failed")}
        )
    errs = get.get("errors", [])
    err_rows: dict[str, list[dict[str, Any]]] = {}
    for r in errs:
        err_rows.setdefault(r["queue"], []).append(
            {k: r[k] for k in ("label", "error", "failed", "recovered", "example_id", "example")}
        )
    windows: dict[str, list[dict[str, Any]]] = {}
    for r in get.get("queue_windows", []):
        windows.setdefault(r["queue"], []).append(
            {
                "start": r["window_start"],
                "processed": r["processed"],
                "failed": r["failed"],
                "throughput_per_s": r["throughput_per_s"],
                **{
                    f"{short}_{key}": r[f"{prefix}_{key}_ms"]
                    for short, prefix in (("q", "queue_latency"), ("e2e", "e2e_latency"))
                    for key in ("p50", "p95", "p99", "max", "mean")
                },
            }
        )
    queue_list = []
    # Archived queues whose tables are gone are still reported.
    for q in sorted(set(queues) | set(by_queue)):
        rec = by_queue.get(q)
        queue_list.append(
            {
                "queue": q,
                **(_metrics(rec) if rec else _metrics(dict(ZERO))),
                "labels": labels.get(q, []),
                "retries": retry_rows.get(q, []),
                "versions": version_rows.get(q, []),
                "top_errors": err_rows.get(q, [])[: opts.top_errors],
                "windows": windows.get(q, []),
            }
        )
    return {
        "title": opts.title,
        "generated_at": _plain(datetime.now(UTC)),
        "source": {
            "database": jdbc.where if jdbc else None,  # None: the archive alone
            "schema": opts.schema,
            "archive_dir": opts.archive_dir,
            "queues": queues,
        },
        "window": opts.window,
        "window_seconds": WINDOWS[opts.window],
        "since": _plain(opts.since),
        "until": _plain(opts.until),
        "percentiles": {
            "method": "percentile_approx",
            "accuracy": opts.accuracy,
            "rank_error": f"ceil(n/{opts.accuracy}) + 1",
        },
        "overall": _metrics(overall[0]),
        "queues": queue_list,
        "top_errors": [
            {
                k: r[k]
                for k in ("queue", "label", "error", "failed", "recovered", "example_id", "example")
            }
            for r in errs[: opts.top_errors]
        ],
        "options": {k: _plain(v) for k, v in asdict(opts).items() if k != "dsn"},
    }


def write_report(spark: Any, summary: dict[str, Any], written: dict[str, str], out: str) -> None:
    """``summary.json`` and ``report.html``, which name the Parquet tables ``written``."""
    summary["outputs"] = {"parquet": written, "json": "summary.json", "html": "report.html"}
    _write_text(spark, _join(out, "summary.json"), json.dumps(summary, indent=2) + "\n")
    _write_text(spark, _join(out, "report.html"), report_html.render(summary))
