"""The demo's SQL, loaded once from ``queries.sql`` beside it by the adapter's loader."""

from __future__ import annotations

from nmbus.postgres.sql import fill, load

QUERIES: dict[str, str] = load("nmbus.demo")


def render(name: str, schema: str, queue: str | None = None) -> str:
    """The demo query ``name`` with identifiers for ``schema`` and ``queue`` filled in."""
    return fill(QUERIES[name], schema, queue)
