"""nmbus statistics job: latency and failure figures of every queue, on Spark.

Reads the processed (``X``) and failed (``F``) rows of every queue table over
JDBC, split into ranges of ``id`` so every executor reads its own slice, plus
the Parquet files retention archived (``<archive>/queue=<q>/day=<d>/*.parquet``),
counting each (queue, id) once. It writes:

* ``parquet/<table>``: windows, queue_windows, labels, queues, retries, errors;
* ``summary.json``: the same figures for scripts;
* ``report.html``: one self-contained page with charts.

Run it on any master, with its sibling files zipped for ``--py-files``::

    python -m zipfile -c nmbus-stats.zip nmbus/stats/*.py
    spark-submit --jars /usr/share/java/postgresql.jar --py-files nmbus-stats.zip \\
        nmbus/stats/job.py --dsn postgresql://user@db:5432/app --out hdfs:///reports/nmbus

This file imports only pyspark, the standard library and ``report_html``
(a sibling file), so it runs where nmbus is not installed. Definitions:

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

import argparse
import json
import math
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

try:  # a module of the nmbus package
    from nmbus.stats import report_html
except ImportError:  # a plain file under spark-submit: the sibling is on sys.path
    import report_html  # type: ignore[no-redef]

JDBC_JAR_CANDIDATES = (
    "/usr/share/java/postgresql.jar",
    "/usr/share/java/postgresql-jdbc4.jar",
)
JDBC_DRIVER = "org.postgresql.Driver"
INSTALL_HINT = (
    "The PostgreSQL JDBC driver was not found. Install Debian's package:\n"
    "    sudo apt-get install libpostgresql-jdbc-java\n"
    "which provides /usr/share/java/postgresql.jar, or point --jdbc-jar (or the\n"
    "NMBUS_JDBC_JAR variable) at a postgresql JDBC jar. With spark-submit pass it as\n"
    "    spark-submit --jars /usr/share/java/postgresql.jar ..."
)
# "second" suits short runs such as the demo's, which fit in one minute.
WINDOWS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}
PERCENTILES = (0.5, 0.95, 0.99)
DEFAULT_ACCURACY = 10_000
# Below this many ids per slice, one more JDBC partition costs more than it saves.
MIN_IDS_PER_PARTITION = 50_000
NO_LABEL = "(none)"
NO_ERROR = "(no error recorded)"


class StatsError(Exception):
    """A problem the operator can fix; the message says how."""


@dataclass
class Options:
    """Everything the job needs; the command line and ``nmbus report`` build one."""

    dsn: str = field(repr=False)  # it may hold a password
    out: str = "nmbus-report"
    schema: str = "nmbus"
    window: str = "hour"
    since: datetime | None = None
    until: datetime | None = None
    partitions: int = 8
    archive_dir: str | None = None
    queues: list[str] = field(default_factory=list)
    accuracy: int = DEFAULT_ACCURACY
    top_errors: int = 10
    write_table: bool = False
    fetch_size: int = 10_000
    title: str = "nmbus report"

    def validate(self) -> None:
        if self.window not in WINDOWS:
            raise StatsError(f"--window must be one of {', '.join(WINDOWS)}, not {self.window!r}")
        if self.partitions < 1:
            raise StatsError("--partitions must be at least 1")
        if not 100 <= self.accuracy <= 10_000_000:
            raise StatsError("--accuracy must be between 100 and 10000000")
        if self.since and self.until and self.since >= self.until:
            raise StatsError("--since must be before --until")
        if not self.schema.replace("_", "a").isalnum():
            raise StatsError(f"invalid schema name {self.schema!r}")


# --------------------------------------------------------------------------- inputs


def parse_time(text: str) -> datetime:
    """An ISO 8601 time (naive means UTC), or a span back from now such as 2h, 30m, 7d."""
    text = text.strip()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    if text and text[-1] in units and text[:-1].replace(".", "", 1).isdigit():
        return datetime.now(UTC) - timedelta(seconds=float(text[:-1]) * units[text[-1]])
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise StatsError(
            f"cannot read time {text!r}: use ISO 8601 (2024-05-01T12:00) or a span (2h, 7d)"
        ) from exc
    return value if value.tzinfo else value.replace(tzinfo=UTC)


@dataclass
class Jdbc:
    url: str
    user: str | None
    password: str | None = field(repr=False)  # never in a log line or a traceback
    host: str
    port: int
    database: str

    def properties(self, fetch_size: int = 10_000) -> dict[str, str]:
        props = {"driver": JDBC_DRIVER, "fetchsize": str(fetch_size)}
        if self.user:
            props["user"] = self.user
        if self.password:
            props["password"] = self.password
        return props

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}/{self.database}"


def jdbc_from_dsn(dsn: str) -> Jdbc:
    """Turn ``postgresql://user:pw@host:port/db?opts`` (or a jdbc: URL) into JDBC settings."""
    if dsn.startswith("jdbc:"):
        dsn = dsn[len("jdbc:") :]
    parts = urlsplit(dsn)
    if parts.scheme not in ("postgresql", "postgres"):
        # Not the DSN itself: it may hold a password.
        raise StatsError(
            "the DSN must look like postgresql://user@host:5432/db, "
            f"not {parts.scheme + '://...' if parts.scheme else 'a URL without a scheme'}"
        )
    host = parts.hostname or "localhost"
    try:
        port = parts.port or 5432
    except ValueError as exc:
        raise StatsError(f"bad port in DSN: {exc}") from exc
    database = unquote(parts.path.lstrip("/")) or (parts.username or "postgres")
    query = dict(parse_qsl(parts.query))
    user = unquote(parts.username) if parts.username else query.pop("user", None)
    password = unquote(parts.password) if parts.password else query.pop("password", None)
    password = password or os.environ.get("PGPASSWORD")
    netloc_host = f"[{host}]" if ":" in host else host
    url = f"jdbc:postgresql://{netloc_host}:{port}/{database}"
    if query:
        url += "?" + urlencode(query)
    return Jdbc(url, user or os.environ.get("PGUSER"), password, host, port, database)


def check_reachable(jdbc: Jdbc, timeout: float = 5.0) -> None:
    """Fail in seconds, before Spark starts, when nothing listens at the DSN's address."""
    try:
        with socket.create_connection((jdbc.host, jdbc.port), timeout=timeout):
            pass
    except OSError as exc:
        raise StatsError(
            f"cannot reach PostgreSQL at {jdbc.host}:{jdbc.port} ({exc.strerror or exc}); "
            "is the server running and is the DSN right?"
        ) from exc


def find_jdbc_jar(explicit: str | None = None) -> str:
    """The PostgreSQL JDBC jar: ``explicit``, ``$NMBUS_JDBC_JAR`` or Debian's package."""
    for candidate in (explicit, os.environ.get("NMBUS_JDBC_JAR"), *JDBC_JAR_CANDIDATES):
        if candidate and os.path.isfile(candidate):
            return candidate
        if candidate and candidate in (explicit, os.environ.get("NMBUS_JDBC_JAR")):
            raise StatsError(f"JDBC jar {candidate!r} does not exist.\n{INSTALL_HINT}")
    raise StatsError(INSTALL_HINT)


def build_session(
    master: str | None = "local[*]",
    jdbc_jar: str | None = None,
    driver_memory: str = "2g",
    shuffle_partitions: int | None = None,
) -> Any:
    """A SparkSession for ``nmbus report``: the JDBC jar on the classpath, UTC, quiet."""
    from pyspark.sql import SparkSession

    jar = find_jdbc_jar(jdbc_jar)
    builder = SparkSession.builder.appName("nmbus-stats")
    if master:
        builder = builder.master(master)
    builder = (
        builder.config("spark.jars", jar)
        .config("spark.driver.memory", driver_memory)
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
    )
    if shuffle_partitions is None and (master or "").startswith("local"):
        # The result sets are small; 200 shuffle tasks would cost more than the work.
        shuffle_partitions = max(4, 2 * (os.cpu_count() or 2))
    if shuffle_partitions:
        builder = builder.config("spark.sql.shuffle.partitions", str(shuffle_partitions))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def active_session() -> Any | None:
    """The SparkSession already running in this process, if any (it is not ours to stop)."""
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession()


def check_driver(spark: Any) -> None:
    """Say how to install the JDBC driver when the session cannot load it."""
    jvm = getattr(spark, "_jvm", None)
    if jvm is None:  # Spark Connect: the server's classpath is not ours to check
        return
    try:
        loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
        jvm.java.lang.Class.forName(JDBC_DRIVER, True, loader)
    except Exception as exc:
        raise StatsError(INSTALL_HINT) from exc


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def quote_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def sql_time(value: datetime) -> str:
    return f"TIMESTAMPTZ '{value.astimezone(UTC).isoformat()}'"


def _jdbc_error(exc: Exception, jdbc: Jdbc, doing: str) -> StatsError:
    text = str(exc)
    for marker in ("PSQLException: ", "SQLException: ", "ClassNotFoundException: "):
        if marker in text:
            text = text.split(marker, 1)[1]
            break
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if "ClassNotFound" in str(exc) or "No suitable driver" in str(exc):
        return StatsError(INSTALL_HINT)
    return StatsError(f"{doing} at {jdbc.where} failed: {first}")


def _query(spark: Any, jdbc: Jdbc, sql: str, doing: str) -> list[Any]:
    try:
        return (
            spark.read.format("jdbc")
            .option("url", jdbc.url)
            .option("query", sql)
            .options(**jdbc.properties())
            .load()
            .collect()
        )
    except Exception as exc:
        raise _jdbc_error(exc, jdbc, doing) from exc


def list_queues(spark: Any, jdbc: Jdbc, opts: Options) -> list[str]:
    schema = quote_ident(opts.schema)
    present = _query(
        spark,
        jdbc,
        f"SELECT to_regclass({quote_literal(quote_ident(opts.schema) + '.queues')}) IS NOT NULL"
        " AS present",
        "reading the queue list",
    )
    if not present[0]["present"]:
        raise StatsError(
            f"schema {opts.schema!r} has no nmbus queue registry ({opts.schema}.queues) "
            f"in database {jdbc.where}; is it the right database and --schema?"
        )
    rows = _query(
        spark,
        jdbc,
        f"SELECT name FROM {schema}.queues "
        f"WHERE to_regclass(format('%I.%I', {quote_literal(opts.schema)}::text, name)) "
        "IS NOT NULL ORDER BY name",
        "reading the queue list",
    )
    names = [r["name"] for r in rows]
    if opts.queues:
        missing = sorted(set(opts.queues) - set(names))
        if missing:
            raise StatsError(f"no such queue(s) in {opts.schema}: {', '.join(missing)}")
        names = [n for n in names if n in opts.queues]
    return names


def id_bounds(spark: Any, jdbc: Jdbc, opts: Options, queues: list[str]) -> dict[str, tuple]:
    """(min id, max id) of each queue table, from the primary key index: no scan."""
    if not queues:
        return {}
    parts = [
        f"SELECT {quote_literal(q)}::text AS queue, min(id) AS lo, max(id) AS hi "
        f"FROM {quote_ident(opts.schema)}.{quote_ident(q)}"
        for q in queues
    ]
    rows = _query(spark, jdbc, " UNION ALL ".join(parts), "reading queue id ranges")
    return {r["queue"]: (r["lo"], r["hi"]) for r in rows}


def _time_predicate(opts: Options, column: str) -> list[str]:
    preds = []
    if opts.since:
        preds.append(f"{column} >= {sql_time(opts.since)}")
    if opts.until:
        preds.append(f"{column} < {sql_time(opts.until)}")
    return preds


def read_queue(spark: Any, jdbc: Jdbc, opts: Options, queue: str, lo: int, hi: int) -> Any:
    """X and F rows of one queue, read in id ranges; the first error line is cut in SQL."""
    from pyspark.sql import functions as F

    where = ["subqueue IN ('X', 'F')"]
    where += _time_predicate(opts, "coalesce(last_processed, retry_time, insert_time)")
    table = (
        "(SELECT id, subqueue::text AS subqueue, label, insert_time, last_processed, "
        "retry_count, retry_time, "
        "regexp_replace(split_part(error_info, E'\\n', 1), '\\s+$', '') AS error "
        f"FROM {quote_ident(opts.schema)}.{quote_ident(queue)} "
        f"WHERE {' AND '.join(where)}) AS nmbus_stats_src"
    )
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


# --------------------------------------------------------------------------- figures


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


# --------------------------------------------------------------------------- outputs


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        # pyspark hands back naive times in the local zone; astimezone reads them so.
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _records(df: Any) -> list[dict[str, Any]]:
    return [{k: _plain(v) for k, v in row.asDict().items()} for row in df.collect()]


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


def run(spark: Any, opts: Options) -> Result:
    """Read, compute and write everything; returns the summary."""
    from pyspark import StorageLevel

    opts.validate()
    started = time.perf_counter()
    jdbc = jdbc_from_dsn(opts.dsn)
    check_reachable(jdbc)
    check_driver(spark)
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    queues = list_queues(spark, jdbc, opts)
    bounds = id_bounds(spark, jdbc, opts, queues)

    parts = [
        read_queue(spark, jdbc, opts, q, *bounds[q])
        for q in queues
        if bounds.get(q) and bounds[q][0] is not None
    ]
    archived = read_archive(spark, opts, queues) if opts.archive_dir else None
    source = None
    for part in parts:
        part = part.select("queue", *(c for c in ARCHIVE_COLUMNS if c != "error_info"), "error")
        source = part if source is None else source.unionByName(part)
    if archived is not None:
        source = archived if source is None else source.unionByName(archived)
        # A row archived and still live (or archived twice) is one message.
        source = source.dropDuplicates(["queue", "id"])

    tables: dict[str, Any] = {}
    if source is not None:
        rows = prepare(source, opts.window).persist(StorageLevel.MEMORY_AND_DISK)
        try:
            agg = aggregate(spark, rows, opts).persist(StorageLevel.MEMORY_AND_DISK)
            for level in ("windows", "queue_windows", "labels", "queues", "overall"):
                tables[level] = finish_level(agg, level, opts)
            tables["retries"] = retries(rows)
            tables["errors"] = errors(rows)
            written = _write_tables(tables, opts)
            summary = _summary(tables, opts, queues, jdbc)
            row_count = int(summary["overall"]["total"])
            agg.unpersist()
        finally:
            rows.unpersist()
    else:
        written = {}
        summary = _summary({}, opts, queues, jdbc)
        row_count = 0

    if opts.write_table and tables:
        _write_back(tables, jdbc, opts)
    elapsed = time.perf_counter() - started
    summary["run"] = {
        "seconds": round(elapsed, 3),
        "rows": row_count,
        "rows_per_second": round(row_count / elapsed, 1) if elapsed > 0 else None,
        "spark_master": spark.sparkContext.master,
        "spark_version": spark.version,
    }
    summary["outputs"] = {"parquet": written, "json": "summary.json", "html": "report.html"}
    _write_text(spark, _join(opts.out, "summary.json"), json.dumps(summary, indent=2) + "\n")
    _write_text(spark, _join(opts.out, "report.html"), report_html.render(summary))
    return Result(summary, opts.out, elapsed, row_count, written)


def _write_tables(tables: dict[str, Any], opts: Options) -> dict[str, str]:
    written = {}
    for name, df in tables.items():
        path = _join(opts.out, "parquet", name)
        df.write.mode("overwrite").parquet(path)
        written[name] = f"parquet/{name}"
    return written


def _write_back(tables: dict[str, Any], jdbc: Jdbc, opts: Options) -> None:
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
            raise _jdbc_error(exc, jdbc, f"writing {target}") from exc


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


def _summary(tables: dict[str, Any], opts: Options, queues: list[str], jdbc: Jdbc) -> dict:
    # The per-type-and-window table can be large; it stays in Parquet (and the database).
    get = {name: _records(df) for name, df in tables.items() if name != "windows"}
    overall = get.get("overall") or [dict(ZERO)]
    by_queue = {r["queue"]: r for r in get.get("queues", [])}
    labels: dict[str, list] = {}
    for r in get.get("labels", []):
        labels.setdefault(r["queue"], []).append({"label": r["label"], **_metrics(r)})
    retry_rows: dict[str, list] = {}
    for r in get.get("retries", []):
        retry_rows.setdefault(r["queue"], []).append(
            {k: r[k] for k in ("label", "outcome", "retry_count", "messages")}
        )
    errs = get.get("errors", [])
    err_rows: dict[str, list] = {}
    for r in errs:
        err_rows.setdefault(r["queue"], []).append(
            {k: r[k] for k in ("label", "error", "failed", "recovered", "example_id")}
        )
    windows: dict[str, list] = {}
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
                "top_errors": err_rows.get(q, [])[: opts.top_errors],
                "windows": windows.get(q, []),
            }
        )
    return {
        "title": opts.title,
        "generated_at": _plain(datetime.now(UTC)),
        "source": {
            "database": jdbc.where,
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
            {k: r[k] for k in ("queue", "label", "error", "failed", "recovered", "example_id")}
            for r in errs[: opts.top_errors]
        ],
        "options": {k: _plain(v) for k, v in asdict(opts).items() if k != "dsn"},
    }


# --------------------------------------------------------------------------- command line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nmbus-stats",
        description="Latency and failure statistics of nmbus queues, on Spark.",
    )
    p.add_argument("--dsn", default=os.environ.get("NMBUS_DSN"), help="postgresql://... DSN")
    p.add_argument("--out", default="nmbus-report", help="output directory (any Hadoop path)")
    p.add_argument("--schema", default=os.environ.get("NMBUS_SCHEMA_NAME", "nmbus"))
    p.add_argument("--window", default="hour", choices=sorted(WINDOWS))
    p.add_argument("--since", type=parse_time, help="ISO time or span back (2h, 7d); inclusive")
    p.add_argument("--until", type=parse_time, help="ISO time or span back; exclusive")
    p.add_argument("--partitions", type=int, default=8, help="JDBC partitions per queue (max)")
    p.add_argument("--archive-dir", help="retention's Parquet archive (queue=/day= folders)")
    p.add_argument("--queue", action="append", default=[], help="only this queue (repeatable)")
    p.add_argument("--accuracy", type=int, default=DEFAULT_ACCURACY, help="percentile accuracy")
    p.add_argument("--top-errors", type=int, default=10)
    p.add_argument("--write-table", action="store_true", help="also write stats_* tables")
    p.add_argument("--fetch-size", type=int, default=10_000, help="JDBC rows per round trip")
    p.add_argument("--master", help="Spark master when not started by spark-submit")
    p.add_argument("--jdbc-jar", help="PostgreSQL JDBC jar when not passed with --jars")
    return p


def options_from_args(args: argparse.Namespace) -> Options:
    if not args.dsn:
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
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        opts = options_from_args(args)
        opts.validate()
        check_reachable(jdbc_from_dsn(opts.dsn))
        from pyspark.sql import SparkSession

        if SparkSession.getActiveSession() is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
            spark = build_session(args.master or "local[*]", args.jdbc_jar)
        else:  # started by spark-submit: master and --jars come from there
            spark = SparkSession.builder.appName("nmbus-stats").getOrCreate()
        try:
            result = run(spark, opts)
        finally:
            spark.stop()
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
