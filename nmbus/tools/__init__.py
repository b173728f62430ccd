"""nmbus's tools: the benchmarks and the kill soak.

Also the statistics job's own tools: ``stats_seed`` fills a database with
synthetic traffic and ``stats_bench`` times the job against one SQL query.

They run the library; the library never imports them. ``import nmbus`` and
``nmbus worker`` load nothing from here (the ``nmbus bench`` and ``soak``
commands import their tool when they run), so a service process carries no
benchmark code.

Their SQL is in ``queries.sql`` beside them, read by :mod:`nmbus.tools.sql`.
"""
