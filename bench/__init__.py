"""The repository's benchmarks and soak: run from a checkout, not shipped in the wheel.

``python -m bench MODE ...`` runs nmbus bench's six modes and the ones here
(peers, fanout, scaling, delivery, routed, reply, retention, flow, burst) through
nmbus's own runner (:mod:`nmbus.bench.runner`, catalogue in :mod:`bench.modes`);
``python -m bench.soak`` is the kill soak; the other tools (``bench.dashboard``,
``bench.archive``, ``bench.stats``, ``bench.stats_seed``, ``bench.stats_events``,
``bench.archive_seed``) run as ``python -m bench.<tool>``. bench/README.md lists
each command.

bench imports nmbus (its runner, scratch schema and SQL among them); nothing in
nmbus imports bench.
"""
