"""nmbus's tools: the demo, the benchmarks, the kill soak and the embedded PostgreSQL.

Also the statistics job's own tools: ``stats_seed`` fills a database with
synthetic traffic and ``stats_bench`` times the job against one SQL query.

They run the library; the library never imports them. ``import nmbus`` and
``nmbus worker`` load nothing from here (the ``nmbus demo``, ``bench`` and
``soak`` commands import their tool when they run), so a service process
registers no demo message types and carries no benchmark code.

Their SQL is in ``queries.sql`` beside them, read by :mod:`nmbus.tools.sql`.
"""
