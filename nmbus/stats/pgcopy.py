"""Rows without JDBC: the driver exports them with PostgreSQL's COPY into Parquet files.

On a local master the executors share the driver's disk, so the job needs no
JDBC driver (no Java jar) at all: each queue's X and F rows, selected by the
very SELECT the JDBC reader sends (``source.select_sql``), are streamed with
``COPY (...) TO STDOUT (FORMAT csv)`` over asyncpg into a CSV file, turned into
one Parquet file per queue by pyarrow, and read by Spark from there.
Timestamps travel as integer microseconds since the epoch, so nothing is lost
or reinterpreted on the way; the text columns keep NULL apart from ''.

Needs asyncpg and pyarrow on the driver (both come with ``nmbus[spark]``).
The files live in a folder of their own that ``export`` creates and the caller
removes (``Staged.remove``). On a cluster, this folder would have to be on a
file system every executor sees; the JDBC reader is the path there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

from .jdbc import Jdbc, quote_ident
from .options import Options, StatsError
from .source import no_registry, pick_queues, queues_sql, registry_sql, select_sql

# Queues exported at once (one connection each).
CONCURRENCY = 4
TIMES = ("insert_time", "last_processed", "retry_time")
COLUMNS = ("id", "subqueue", "label", *TIMES, "retry_count", "error", "version")


@dataclass
class Staged:
    """The exported rows: one Parquet file per queue that has any, in ``folder``."""

    folder: str
    queues: list[str]
    files: dict[str, str] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _micros(column: str) -> str:
    # Exact on every PostgreSQL version: whole seconds, then the microseconds within.
    return (
        f"(extract(epoch FROM date_trunc('second', {column}))::bigint * 1000000 "
        f"+ extract(microseconds FROM {column})::bigint % 1000000) AS {column}"
    )


def copy_sql(opts: Options, queue: str) -> str:
    select = ", ".join(
        [
            "id",
            "subqueue",
            "label",
            *(_micros(t) for t in TIMES),
            "retry_count",
            "error",
            "version",
        ]
    )
    return f"SELECT {select} FROM ({select_sql(opts, queue)}) AS nmbus_stats_src"


def _schema() -> Any:
    import pyarrow as pa

    ts = pa.timestamp("us", tz="UTC")
    return pa.schema(
        [
            ("id", pa.int64()),
            ("subqueue", pa.string()),
            ("label", pa.string()),
            *((t, ts) for t in TIMES),
            ("retry_count", pa.int32()),
            ("error", pa.string()),
            ("version", pa.int32()),
        ]
    )


def csv_to_parquet(csv_path: str, parquet_path: str) -> int:
    """Stream a COPY csv file into Parquet; returns the rows written."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    if os.path.getsize(csv_path) == 0:
        return 0  # no rows (pyarrow refuses an empty CSV file)
    schema = _schema()
    raw = {name: (pa.int64() if name in TIMES else schema.field(name).type) for name in COLUMNS}
    reader = pcsv.open_csv(
        csv_path,
        read_options=pcsv.ReadOptions(column_names=list(COLUMNS), block_size=16 << 20),
        parse_options=pcsv.ParseOptions(newlines_in_values=True),
        convert_options=pcsv.ConvertOptions(
            column_types=raw,
            null_values=[""],
            strings_can_be_null=True,
            quoted_strings_can_be_null=False,  # '' stays '', as PostgreSQL quotes it
        ),
    )
    rows = 0
    with pq.ParquetWriter(parquet_path, schema) as writer:
        for batch in reader:
            columns = [
                batch.column(i).cast(schema.field(i).type) if name in TIMES else batch.column(i)
                for i, name in enumerate(COLUMNS)
            ]
            writer.write_batch(pa.RecordBatch.from_arrays(columns, schema=schema))
            rows += batch.num_rows
    return rows


def _dsn(dsn: str) -> str:
    return dsn[len("jdbc:") :] if dsn.startswith("jdbc:") else dsn


async def _connect(opts: Options, jdbc: Jdbc) -> Any:
    import asyncpg

    try:
        return await asyncpg.connect(
            _dsn(opts.dsn or ""),
            timeout=30,
            server_settings={"application_name": "nmbus-stats"},
        )
    except asyncpg.InvalidCatalogNameError as exc:
        raise StatsError(
            f"database {jdbc.database!r} does not exist at {jdbc.host}:{jdbc.port}"
        ) from exc
    except (TimeoutError, OSError) as exc:
        raise StatsError(f"cannot reach PostgreSQL at {jdbc.host}:{jdbc.port} ({exc})") from exc
    except asyncpg.PostgresError as exc:
        raise StatsError(f"connecting to {jdbc.where} failed: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


async def _export(opts: Options, jdbc: Jdbc, staged: Staged) -> None:
    import asyncpg

    conn = await _connect(opts, jdbc)
    try:
        if not await conn.fetchval(registry_sql(opts)):
            raise no_registry(opts, jdbc.where)
        names = [r["name"] for r in await conn.fetch(queues_sql(opts))]
    finally:
        await conn.close()
    staged.queues = pick_queues(opts, names)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(queue: str, index: int) -> None:
        csv_path = os.path.join(staged.folder, f"q{index}.csv")
        parquet_path = os.path.join(staged.folder, f"q{index}.parquet")
        async with gate:
            conn = await _connect(opts, jdbc)
            try:
                await conn.copy_from_query(copy_sql(opts, queue), output=csv_path, format="csv")
            except asyncpg.PostgresError as exc:
                raise StatsError(
                    f"reading {opts.schema}.{quote_ident(queue)} at {jdbc.where} failed: "
                    f"{_first_line(exc)}"
                ) from exc
            finally:
                await conn.close()
        rows = await asyncio.to_thread(csv_to_parquet, csv_path, parquet_path)
        os.unlink(csv_path)
        staged.rows[queue] = rows
        if rows:
            staged.files[queue] = parquet_path

    await asyncio.gather(*(one(q, i) for i, q in enumerate(staged.queues)))
    # Queue order, not completion order: the union is then the same every run.
    staged.files = {q: staged.files[q] for q in staged.queues if q in staged.files}


def export(opts: Options, jdbc: Jdbc) -> Staged:
    """List the queues and export their X and F rows; the caller removes the folder."""
    if opts.copy_dir:
        os.makedirs(opts.copy_dir, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="nmbus-stats-copy-", dir=opts.copy_dir)
    staged = Staged(folder, [])
    try:
        _run(_export(opts, jdbc, staged))
    except BaseException:
        staged.remove()
        raise
    return staged


def _run(coro: Any) -> Any:
    """asyncio.run, also from code that already runs inside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
