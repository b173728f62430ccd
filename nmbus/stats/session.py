"""The SparkSession of a local run (``nmbus report``, the demo, the tests).

Under spark-submit the session comes from there instead; see ``job.main``.
"""

from __future__ import annotations

import os
from typing import Any

try:  # a module of the nmbus package
    from nmbus.stats.jdbc import find_jdbc_jar
except ImportError:  # a plain file under spark-submit: the siblings are on sys.path
    from jdbc import find_jdbc_jar  # type: ignore[no-redef]


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


def command_line_session(master: str | None, jdbc_jar: str | None) -> Any:
    """The session of job.py's command line: spark-submit's if it started us, else our own."""
    from pyspark.sql import SparkSession

    if SparkSession.getActiveSession() is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
        return build_session(master or "local[*]", jdbc_jar)
    # Started by spark-submit: master and --jars come from there.
    return SparkSession.builder.appName("nmbus-stats").getOrCreate()
