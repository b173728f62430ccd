"""Time the statistics job over a retention archive alone (no PostgreSQL, no JDBC).

    python -m bench.archive --sizes 1000000,5000000,10000000 --master 'local[2]'

For each size: write a synthetic archive in retention's format
(``bench.archive_seed``), then time in one Spark session, started once
before the first size:

* ``ceiling``: a plain Spark scan of the same files and columns, grouped by
  queue (the least any job reading them can cost);
* ``job``: ``job.run`` with ``dsn=None`` and ``archive_dir``: every figure,
  every output file.

Prints rows, seconds, microseconds per row, the ratio job/ceiling, the
marginal cost per row between sizes and the load average, one line per size;
the archive is deleted after its size unless ``--keep``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.archive_seed import write_archive


def _ceiling(spark: Any, archive: Path) -> tuple[float, int]:
    from pyspark.sql import functions as F

    started = time.perf_counter()
    rows = (
        spark.read.option("basePath", str(archive))
        .parquet(f"{archive}/queue=*/day=*")
        .select("queue", "id", "subqueue", "retry_count", "last_processed", "retry_time")
        .groupBy("queue")
        .agg(
            F.count(F.lit(1)).alias("n"),
            F.sum("retry_count"),
            F.max(F.unix_micros("last_processed") - F.unix_micros("retry_time")),
        )
        .collect()
    )
    return time.perf_counter() - started, sum(int(r["n"]) for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.archive", description=__doc__)
    p.add_argument("--sizes", default="1000000,5000000,10000000")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--driver-memory", default="3g")
    p.add_argument("--dir", type=Path, help="where archives are written (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep each archive")
    p.add_argument("--window", default="hour")
    p.add_argument(
        "--conf", action="append", default=[], metavar="KEY=VALUE", help="a Spark setting"
    )
    args = p.parse_args(argv)
    conf = dict(item.split("=", 1) for item in args.conf)
    sizes = [int(s) for s in args.sizes.split(",") if s]

    from nmbus.stats import job

    base = args.dir or Path(tempfile.mkdtemp(prefix="nmbus-archive-bench-"))
    spark = job.build_session(
        args.master,
        None,
        args.driver_memory,
        need_jdbc=False,
        extra_conf=conf,
        expected_rows=max(sizes),
    )
    print(
        f"spark {spark.version} on {args.master}, java "
        f"{spark._jvm.java.lang.System.getProperty('java.version')}",
        flush=True,
    )
    previous: tuple[int, float] | None = None
    try:
        for size in sizes:
            archive = base / f"archive-{size}"
            t = time.perf_counter()
            files = write_archive(archive, size, ["billing", "warehouse", "notifications"], 7)
            written = time.perf_counter() - t
            mb = sum(f.stat().st_size for f in files) / 1e6
            ceiling, counted = _ceiling(spark, archive)
            out = base / f"report-{size}"
            opts = job.Options(dsn=None, archive_dir=str(archive), out=str(out))
            opts.window = args.window
            t = time.perf_counter()
            result = job.run(spark, opts)
            seconds = time.perf_counter() - t
            rows = result.rows
            assert rows == counted == size, (rows, counted, size)
            marginal = ""
            if previous:
                d_rows, d_s = rows - previous[0], seconds - previous[1]
                marginal = f" marginal={d_s / d_rows * 1e6:.2f}us/row"
            load = "/".join(f"{x:.1f}" for x in os.getloadavg())
            print(
                f"rows={rows:,} files={len(files)} parquet={mb:.0f}MB (written in {written:.0f}s) "
                f"job={seconds:.1f}s {seconds / rows * 1e6:.2f}us/row "
                f"ceiling={ceiling:.1f}s {ceiling / rows * 1e6:.2f}us/row "
                f"ratio={seconds / ceiling:.1f}{marginal} load={load}",
                flush=True,
            )
            previous = (rows, seconds)
            shutil.rmtree(out, ignore_errors=True)
            if not args.keep:
                shutil.rmtree(archive, ignore_errors=True)
    finally:
        job.stop_session(spark)
        if not args.dir and not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
