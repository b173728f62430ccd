"""The statistics job: latency and failure figures of every queue, on Spark.

``job.py`` is the PySpark job's entry point (run it with ``spark-submit`` or
``nmbus report``); its siblings do the work, one concern each: ``options.py``,
``jdbc.py``, ``session.py``, ``source.py`` and ``pgcopy.py`` (reading), ``aggregate.py`` (the
figures), ``outputs.py`` (writing) and ``report_html.py`` (the summary as one
self-contained HTML page). They import only pyspark, the standard library and
each other (and nmbus's error tree when it is installed), so they also run as
plain files on a cluster where nmbus is not installed.
``nmbus.tools.stats_seed`` / ``stats_bench`` fill a database with synthetic
traffic and time the job against a single SQL query.
"""
