"""The statistics job: latency and failure figures of every queue, on Spark.

``job.py`` is the PySpark job (run it with ``spark-submit`` or ``nmbus report``),
``report_html.py`` renders its summary as one self-contained HTML page
(``nmbus.tools.stats_seed`` / ``stats_bench`` fill a database with synthetic
traffic and time the job against a single SQL query). ``job.py`` and ``report_html.py`` import only
pyspark, the standard library and each other, so they also run as plain files
on a cluster where nmbus is not installed.
"""
