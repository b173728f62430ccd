"""Reading the rows: every queue's X and F rows, and retention's Parquet archive.

Live rows reach Spark one of two ways (``choose_reader``):

* ``jdbc``: a queue table is read in ranges of ``id`` so every executor reads
  its own slice (the path on a cluster);
* ``copy``: the driver exports them with PostgreSQL's COPY into Parquet files
  (``pgcopy.py``) that Spark reads (the path on a local master: no JDBC driver,
  no Java jar at all).

Archived rows come from ``<archive>/queue=<q>/day=<d>/*.parquet``. ``combine``
puts live and archived rows together, counting each (queue, id) once. With no
database at all, the archive alone is read.
"""

from __future__ import annotations

import math
import os
from typing import Any

from .jdbc import Jdbc, query, quote_ident, quote_literal, sql_time
from .options import Options, StatsError


def copy_available() -> bool:
    """Whether this driver can export with COPY: asyncpg and pyarrow importable."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("asyncpg", "pyarrow"))


def choose_reader(opts: Options, master: str | None) -> str:
    """ "archive" (no database), or the source asked for, or copy on a local master."""
    if not opts.dsn:
        return "archive"
    if opts.source != "auto":
        return opts.source
    local = master is None or master == "local" or master.startswith("local[")
    if local and not opts.write_table and copy_available():
        return "copy"
    return "jdbc"


def registry_sql(opts: Options) -> str:
    """One row, ``present``: whether the schema holds nmbus's queue registry."""
    return (
        f"SELECT to_regclass({quote_literal(quote_ident(opts.schema) + '.queues')}) IS NOT NULL"
        " AS present"
    )


def queues_sql(opts: Options) -> str:
    """The registered queues whose tables exist, by name."""
    return (
        f"SELECT name FROM {quote_ident(opts.schema)}.queues "
        f"WHERE to_regclass(format('%I.%I', {quote_literal(opts.schema)}::text, name)) "
        "IS NOT NULL ORDER BY name"
    )


def no_registry(opts: Options, where: str) -> StatsError:
    return StatsError(
        f"schema {opts.schema!r} has no nmbus queue registry ({opts.schema}.queues) "
        f"in database {where}; is it the right database and --schema?"
    )


def pick_queues(opts: Options, names: list[str]) -> list[str]:
    if opts.queues:
        missing = sorted(set(opts.queues) - set(names))
        if missing:
            raise StatsError(f"no such queue(s) in {opts.schema}: {', '.join(missing)}")
        names = [n for n in names if n in opts.queues]
    return names


# Below this many ids per slice, one more JDBC partition costs more than it saves.
MIN_IDS_PER_PARTITION = 50_000


def list_queues(spark: Any, jdbc: Jdbc, opts: Options) -> list[str]:
    present = query(spark, jdbc, registry_sql(opts), "reading the queue list")
    if not present[0]["present"]:
        raise no_registry(opts, jdbc.where)
    rows = query(spark, jdbc, queues_sql(opts), "reading the queue list")
    return pick_queues(opts, [r["name"] for r in rows])


def id_bounds(
    spark: Any, jdbc: Jdbc, opts: Options, queues: list[str]
) -> dict[str, tuple[Any, Any]]:
    """(min id, max id) of each queue table, from the primary key index: no scan."""
    if not queues:
        return {}
    parts = [
        f"SELECT {quote_literal(q)}::text AS queue, min(id) AS lo, max(id) AS hi "
        f"FROM {quote_ident(opts.schema)}.{quote_ident(q)}"
        for q in queues
    ]
    rows = query(spark, jdbc, " UNION ALL ".join(parts), "reading queue id ranges")
    return {r["queue"]: (r["lo"], r["hi"]) for r in rows}


def _time_predicate(opts: Options, column: str) -> list[str]:
    preds = []
    if opts.since:
        preds.append(f"{column} >= {sql_time(opts.since)}")
    if opts.until:
        preds.append(f"{column} < {sql_time(opts.until)}")
    return preds


# A row's message version: its nmbus-version header, 1 when there is none (as the
# bus reads it); NULL for a header that is no version, so that no hand-written
# header stops the read.
VERSION_SQL = (
    "CASE WHEN msg_headers->>'nmbus-version' IS NULL THEN 1 "
    "WHEN msg_headers->>'nmbus-version' ~ '^[0-9]{1,9}$' "
    "THEN (msg_headers->>'nmbus-version')::int END"
)


def select_sql(opts: Options, queue: str) -> str:
    """The X and F rows of one queue, the first error line cut and the version read in
    SQL (it is the same SELECT for both readers, so both see the same rows)."""
    where = ["subqueue IN ('X', 'F')"]
    where += _time_predicate(opts, "coalesce(last_processed, retry_time, insert_time)")
    return (
        "SELECT id, subqueue::text AS subqueue, label, insert_time, last_processed, "
        "retry_count, retry_time, "
        "regexp_replace(split_part(error_info, E'\\n', 1), '\\s+$', '') AS error, "
        f"{VERSION_SQL} AS version "
        f"FROM {quote_ident(opts.schema)}.{quote_ident(queue)} "
        f"WHERE {' AND '.join(where)}"
    )


def read_queue(spark: Any, jdbc: Jdbc, opts: Options, queue: str, lo: int, hi: int) -> Any:
    """X and F rows of one queue, read in id ranges."""
    from pyspark.sql import functions as F

    table = f"({select_sql(opts, queue)}) AS nmbus_stats_src"
    span = hi - lo + 1
    partitions = max(1, min(opts.partitions, math.ceil(span / MIN_IDS_PER_PARTITION)))
    reader = (
        spark.read.format("jdbc")
        .option("url", jdbc.url)
        .option("dbtable", table)
        .options(**jdbc.properties(opts.fetch_size))
    )
    if partitions > 1:
        reader = (
            reader.option("partitionColumn", "id")
            .option("lowerBound", str(lo))
            .option("upperBound", str(hi + 1))
            .option("numPartitions", str(partitions))
        )
    return reader.load().withColumn("queue", F.lit(queue))


ARCHIVE_COLUMNS = (
    "id",
    "subqueue",
    "label",
    "insert_time",
    "last_processed",
    "retry_count",
    "retry_time",
    "error_info",
    "msg_headers",
)


def read_archive(spark: Any, opts: Options, queues: list[str]) -> Any | None:
    """Archived rows from Parquet, or None when the archive holds no files."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    path = opts.archive_dir.rstrip("/")  # type: ignore[union-attr]
    schema = T.StructType(
        [
            T.StructField("id", T.LongType()),
            T.StructField("subqueue", T.StringType()),
            T.StructField("label", T.StringType()),
            T.StructField("insert_time", T.TimestampType()),
            T.StructField("last_processed", T.TimestampType()),
            T.StructField("retry_count", T.IntegerType()),
            T.StructField("retry_time", T.TimestampType()),
            T.StructField("error_info", T.StringType()),
            T.StructField("msg_headers", T.StringType()),
            T.StructField("queue", T.StringType()),
            T.StructField("day", T.StringType()),
        ]
    )
    try:
        df = spark.read.schema(schema).option("basePath", path).parquet(f"{path}/queue=*/day=*")
    except Exception as exc:
        if "PATH_NOT_FOUND" in str(exc) or "Path does not exist" in str(exc):
            if not _path_exists(spark, path):
                raise StatsError(f"archive directory {path} does not exist") from exc
            return None  # an archive with nothing in it yet
        raise
    error = F.regexp_replace(F.substring_index("error_info", "\n", 1), r"\s+$", "")
    # As VERSION_SQL reads it in the database.
    header = F.get_json_object("msg_headers", "$['nmbus-version']")
    version = F.when(header.isNull(), F.lit(1)).when(
        header.rlike(r"^[0-9]{1,9}$"), header.cast("int")
    )
    df = df.select(
        "queue",
        "id",
        F.trim("subqueue").alias("subqueue"),
        "label",
        "insert_time",
        "last_processed",
        "retry_count",
        "retry_time",
        error.alias("error"),
        version.alias("version"),
    ).where(F.col("subqueue").isin("X", "F"))
    if opts.queues:
        df = df.where(F.col("queue").isin(*queues))
    event = F.coalesce("last_processed", "retry_time", "insert_time")
    if opts.since:
        df = df.where(event >= F.lit(opts.since))
    if opts.until:
        df = df.where(event < F.lit(opts.until))
    return df


def _path_exists(spark: Any, path: str) -> bool:
    if "://" not in path or path.startswith("file:"):
        return os.path.isdir(path.removeprefix("file://"))
    jvm = spark._jvm
    hpath = jvm.org.apache.hadoop.fs.Path(path)
    fs = hpath.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    return bool(fs.exists(hpath))


LIVE_COLUMNS = (
    "queue",
    *(c for c in ARCHIVE_COLUMNS if c not in ("error_info", "msg_headers")),
    "error",
    "version",
)


def read_rows(spark: Any, jdbc: Jdbc, opts: Options, queues: list[str]) -> Any | None:
    """Live (over JDBC) and archived rows of ``queues`` as one DataFrame, or None."""
    bounds = id_bounds(spark, jdbc, opts, queues)
    parts = [
        read_queue(spark, jdbc, opts, q, *bounds[q])
        for q in queues
        if bounds.get(q) and bounds[q][0] is not None
    ]
    return combine(spark, parts, opts, queues)


def read_copied(spark: Any, opts: Options, files: dict[str, str], queues: list[str]) -> Any | None:
    """Live rows exported by ``pgcopy.export`` (one Parquet file per queue), and the archive."""
    from pyspark.sql import functions as F

    parts = [spark.read.parquet(path).withColumn("queue", F.lit(q)) for q, path in files.items()]
    return combine(spark, parts, opts, queues)


def read_archive_only(spark: Any, opts: Options) -> Any | None:
    """No database: the archive's rows alone (its folders name the queues)."""
    return combine(spark, [], opts, list(opts.queues))


def combine(spark: Any, parts: list[Any], opts: Options, queues: list[str]) -> Any | None:
    """Live parts and the archive as one DataFrame, each (queue, id) once; None when empty."""
    archived = read_archive(spark, opts, queues) if opts.archive_dir else None
    rows = None
    for part in parts:
        part = part.select(*LIVE_COLUMNS)
        rows = part if rows is None else rows.unionByName(part)
    if archived is not None:
        rows = archived if rows is None else rows.unionByName(archived)
        # A row archived and still live (or archived twice) is one message.
        rows = rows.dropDuplicates(["queue", "id"])
    return rows
