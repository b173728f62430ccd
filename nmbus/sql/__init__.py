"""The runtime SQL of nmbus, loaded once from ``queries.sql`` by name.

Queue tables are the one dynamic part of any statement: :func:`render` fills in
schema, table and index names, always through :func:`quote_ident`. The tools'
SQL (:mod:`nmbus.tools.sql`) is another file of named blocks, read by the same
:func:`load` and filled in by the same :func:`fill`.

nmbus's own objects of a table (its indexes, primary key and identity
sequence) are named ``<table>$<role>`` (:func:`own_name`). Queue names cannot
contain ``$``, so these names can never be taken by a queue table, whatever
queues are created and in what order (``orders_uid`` is a fine queue name;
the unique index of ``orders`` is ``orders$uid``).
"""

from __future__ import annotations

import functools
import re
from importlib.resources import files

_BLOCK = re.compile(r"^-- ([a-z_][a-z0-9_]*) --$", re.MULTILINE)


def load(package: str, filename: str = "queries.sql") -> dict[str, str]:
    """The ``-- name --`` blocks of ``filename`` in ``package``, without their comment lines."""
    text = files(package).joinpath(filename).read_text(encoding="utf-8")
    parts = _BLOCK.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = [line for line in body.strip().splitlines() if not line.startswith("--")]
        queries[name] = "\n".join(lines).strip()
    return queries


QUERIES: dict[str, str] = load(__name__)


def quote_ident(name: str) -> str:
    """Quote an SQL identifier the way PostgreSQL's ``quote_ident``/``%I`` does."""
    if "\x00" in name:
        raise ValueError("identifiers cannot contain NUL")
    return '"' + name.replace('"', '""') + '"'


# PostgreSQL silently truncates longer identifiers, which would make names collide again.
MAX_IDENTIFIER_BYTES = 63


def own_name(table: str, role: str) -> str:
    """The name of nmbus's object ``role`` of ``table``.

    Roles: ready, uid, seq, done, pkey, id_seq, saga.
    """
    name = f"{table}${role}"
    if len(name.encode()) > MAX_IDENTIFIER_BYTES:
        raise ValueError(f"{name!r} is longer than PostgreSQL's {MAX_IDENTIFIER_BYTES} bytes")
    return name


def fill(sql: str, schema: str, queue: str | None = None) -> str:
    """``sql`` with the identifiers of ``schema`` and ``queue`` filled in, each one quoted."""
    values = {"schema": quote_ident(schema)}
    if queue is not None:
        values["queue"] = f"{quote_ident(schema)}.{quote_ident(queue)}"
        values["ready_index"] = quote_ident(own_name(queue, "ready"))
        values["unique_index"] = quote_ident(own_name(queue, "uid"))
        values["sequence_index"] = quote_ident(own_name(queue, "seq"))
        values["done_index"] = quote_ident(own_name(queue, "done"))
        values["pkey"] = quote_ident(own_name(queue, "pkey"))
        values["id_seq"] = f"{quote_ident(schema)}.{quote_ident(own_name(queue, 'id_seq'))}"
        if "{saga" in sql:
            saga = own_name(queue, "saga")
            values["saga"] = f"{quote_ident(schema)}.{quote_ident(saga)}"
            values["saga_pkey"] = quote_ident(own_name(saga, "pkey"))
    return sql.format_map(values)


@functools.lru_cache(maxsize=1024)
def render(name: str, schema: str, queue: str | None = None) -> str:
    """The query ``name`` with identifiers for ``schema`` and ``queue`` filled in."""
    return fill(QUERIES[name], schema, queue)
