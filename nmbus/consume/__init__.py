"""The one path a message takes through a worker.

- :mod:`~nmbus.consume.worker`: the producer, the loops of one endpoint, their
  wake-ups (:mod:`~nmbus.consume.wakeups`), claim sizes
  (:mod:`~nmbus.consume.sizing`), turns under saga contention
  (:mod:`~nmbus.consume.turns`), lease renewal and stop;
- :mod:`~nmbus.consume.claim`: one claim, leased under a token of its own,
  owning its rows and what became of them;
- :mod:`~nmbus.consume.batch`: one claimed batch handled in one transaction,
  its outcomes finished with the next claim, in parts when it takes long;
- :mod:`~nmbus.consume.output`: what a batch writes besides its outcomes;
- :mod:`~nmbus.consume.isolation`: after a crash, the suspect run alone;
- :mod:`~nmbus.consume.dispatch`: one message into its handlers.

Nothing here imports the Bus (:mod:`nmbus.bus`) nor an adapter: the worker is
built from a store port, a dispatcher and settings alone.
"""
