"""The ports: what the bus and the worker need of a store (:mod:`~nmbus.ports.store`),
what an operator's tools need (:mod:`~nmbus.ports.operations`), and what retention
is (:mod:`~nmbus.ports.retention`). Two adapters implement them: :mod:`nmbus.postgres`
and :mod:`nmbus.memory`."""
