"""``nmbus bench``: the figures a user measures on their own database.

Six modes (ceiling, drain, transactional, latency, xrows, saga), run by
:mod:`~nmbus.bench.runner` on scratch schemas (:mod:`~nmbus.bench.scratch`),
each measured by :mod:`~nmbus.bench.scenarios` (the saga by
:mod:`~nmbus.bench.saga`). The comparisons with other queues, the kill soak
and the scenario benchmarks are in the repository's ``bench/``, which is not
shipped and reuses this runner.

They run the library; the library never imports them. ``import nmbus`` and
``nmbus worker`` load nothing from here (``nmbus bench`` imports it when it
runs), so a service process carries no benchmark code.

Their SQL is in ``queries.sql`` beside them, read by :mod:`nmbus.bench.sql`.
"""
