"""The statistics job: latency and failure figures of every queue, on Spark.

``job.py`` holds the PySpark job's ``run`` and command line (``nmbus report``
calls it); the other modules do the work, one concern each: ``options.py``,
``jdbc.py``, ``session.py``, ``source.py`` and ``pgcopy.py`` (reading), ``aggregate.py`` (the
figures), ``outputs.py`` (writing) and ``report_html.py`` (the summary as one
self-contained HTML page). They import only pyspark, the standard library and
each other, relatively, never the rest of nmbus: ``ship.py`` zips the package
as ``nmbus_stats`` for ``spark-submit --py-files`` and ``submit.py`` is the file
spark-submit runs, on a cluster where nmbus is not installed.
The repository's ``bench/stats_seed.py`` / ``bench/stats.py`` (not shipped) fill a
database with synthetic traffic and time the job against a single SQL query.
"""
