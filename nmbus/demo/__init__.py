"""``nmbus demo``: a shop of four services on the bus, the report, the embedded PostgreSQL.

- :mod:`~nmbus.demo.services`: the services, their message types and their failures;
- :mod:`~nmbus.demo.report`: the Spark statistics report over the demo's schema;
- :mod:`~nmbus.demo.embedded`: a pip-installed PostgreSQL in a local folder, on TCP
  (:mod:`~nmbus.demo.embedded_root` holds what it changes on the machine as root).

They run the library; the library never imports them. ``import nmbus`` and
``nmbus worker`` load nothing from here (``nmbus demo`` imports it when it runs),
so a service process registers no demo message types.

Their SQL is in ``queries.sql`` beside them, read by :mod:`nmbus.demo.sql`.
"""
