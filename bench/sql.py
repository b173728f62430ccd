"""bench's SQL: its own blocks (``queries.sql`` beside it) and nmbus bench's, by name.

The scratch schema's statements (``drop_schema``, ``bench_preload``, ...) are
nmbus bench's (:mod:`nmbus.bench.sql`); a tool here names either kind the same way.
"""

from __future__ import annotations

from nmbus.bench import sql as nmbus_bench
from nmbus.postgres.sql import fill, load

OWN: dict[str, str] = load("bench")
if OWN.keys() & nmbus_bench.QUERIES.keys():
    raise ValueError(f"bench/queries.sql redefines {sorted(OWN.keys() & nmbus_bench.QUERIES)}")
QUERIES: dict[str, str] = {**nmbus_bench.QUERIES, **OWN}


def render(name: str, schema: str, queue: str | None = None) -> str:
    """The query ``name`` with identifiers for ``schema`` and ``queue`` filled in."""
    return fill(QUERIES[name], schema, queue)
