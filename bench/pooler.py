"""``python -m bench pooler``: nmbus behind PgBouncer in transaction mode, against direct.

In one run, on one server, with a PgBouncer the bench starts in front of it
(bench/pgbouncer.py: the machine's pgbouncer, ``pool_mode = transaction``,
``POOL_SIZE`` server connections, more than the bench's client connections, so
that the figures are the pooler's protocol cost rather than a wait for a server
connection):

- the drain (nmbus bench's: ``messages`` pre-loaded, a worker of ``concurrency``
  loops with a handler that does nothing), straight to PostgreSQL and then with
  ``NMBUS_POOLER=transaction`` through the pooler;
- the latency (nmbus bench's: ``rate`` sends per second for ``seconds`` after
  ``warmup``, milliseconds from the call of ``send`` to the handler's start, p50
  and p99) straight, through the pooler with ``listen_dsn`` (LISTEN straight to
  the server, every other statement through the pooler), and through the pooler
  without it: the loops then look every ``POLL`` seconds.

The queue's table is made and pre-loaded directly (the scratch schema); only the
Bus's own connections go through the pooler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from bench.options import Options
from bench.pgbouncer import PgBouncer
from nmbus.bench.runner import scratch_run
from nmbus.bench.scenarios import measure_drain, measure_latency
from nmbus.settings import Settings

#: Server connections the bench's PgBouncer keeps.
POOL_SIZE = 20
#: The loops' poll behind the pooler without listen_dsn, seconds.
POLL = 0.05


@dataclass
class _Through(Options):
    """The bench's options with every Bus connection through ``pooled``."""

    pooled: str = field(default="", repr=False)
    listen: str | None = field(default=None, repr=False)

    def bus_settings(self, schema: str, **extra: Any) -> Settings:
        values: dict[str, Any] = {"dsn": self.pooled, "pooler": "transaction"}
        values.update({"listen_dsn": self.listen} if self.listen else {"poll_interval": POLL})
        values.update(extra)
        return super().bus_settings(schema, **values)


def _through(options: Options, pooled: str, listen: str | None) -> _Through:
    fields = {k: v for k, v in vars(options).items() if not k.startswith("_")}
    return _Through(**fields, pooled=pooled, listen=listen)


async def measure_pooler(options: Options, progress: Callable[[str], None]) -> dict[str, float]:
    """Drain and latency, direct and through PgBouncer (transaction mode), in one run."""
    database = urlsplit(options.dsn).path.lstrip("/") or "postgres"
    dsn = options.dsn
    figures: dict[str, float] = {}
    with PgBouncer(dsn, "transaction", pool_size=POOL_SIZE) as bouncer:
        pooled = bouncer.dsn(database)
        listening = _through(options, pooled, dsn)
        polling = _through(options, pooled, None)

        progress("pooler: drain, direct")
        direct = await scratch_run(dsn, lambda s: measure_drain(options, s))
        progress("pooler: drain, through PgBouncer")
        through = await scratch_run(dsn, lambda s: measure_drain(listening, s))
        figures["direct_drain_per_s"] = direct
        figures["pooler_drain_per_s"] = through
        figures["drain_ratio_to_direct"] = through / direct

        runs: tuple[tuple[str, Options], ...] = (
            ("direct", options),
            ("listen_dsn", listening),
            ("polling", polling),
        )
        for name, opts in runs:
            progress(f"pooler: latency, {name}")
            got = await scratch_run(dsn, partial(measure_latency, opts))
            figures[f"{name}_p50_ms"] = got["p50_ms"]
            figures[f"{name}_p99_ms"] = got["p99_ms"]
            figures[f"{name}_send_p50_ms"] = got["send_p50_ms"]
        transactions = sum(
            int(row["total_xact_count"])
            for row in bouncer.show("STATS")
            if row["database"] == database
        )
    # Proof that the Bus's traffic went through the pooler (its own count).
    figures["pooler_transactions"] = float(transactions)
    return figures
