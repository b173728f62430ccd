"""The SQL of the PostgreSQL adapter, in files by purpose, loaded once by name.

Every ``.sql`` file of this package (its ``migrations/`` folder included) is read
by :func:`load`:

- ``schema.sql``: the schema's shared tables, the queue table, the queue registry;
- ``migrations/NNN_*.sql``: what brings an older schema to version NNN;
- ``insert.sql``: new messages into a queue table;
- ``runtime.sql``: claim, finish, leases, isolation, sequences;
- ``pubsub.sql``, ``sagas.sql``, ``outbox.sql``: publish/subscribe, sagas, routes;
- ``operations.sql`` and ``retention.sql``: what operators and retention read and change;
- ``segments.sql``: the segments of a queue table, rolled and dropped.

A block starts with a line ``-- name --``, then comment lines saying what it does
and what ``$1..$n`` are. Block names are unique across the files (a second
definition fails the load), so a caller says ``render("claim", ...)`` without
knowing the file.

A block can put another in with ``{name}``: a statement written once serves every
statement that needs it (the claim serves ``claim``, ``finish_claim`` and
``finish_claim_processed``). Such a fragment may have slots ``{:slot}``, given
at each use as ``{name(slot => value, ...)}``: a value is pasted as written (a
parameter ``$7``), unless it names a block (whose text goes in) or is ``''``
(nothing; a slot alone on its line then takes its line with it). A fragment's
lines after its first are indented as the line that puts it in. All of this
happens once, at load: :func:`render` sees finished statements.

Queue tables are the one dynamic part of any statement: :func:`render` fills in
schema, table and index names, always through :func:`quote_ident`. The tools'
SQL (:mod:`nmbus.bench.sql`, :mod:`nmbus.demo.sql`) is in packages of named
blocks of their own, read by the same :func:`load` and filled in by the same
:func:`fill`.

nmbus's own objects of a table (its indexes, primary key and identity
sequence) are named ``<table>$<role>`` (:func:`own_name`). Queue names cannot
contain ``$``, so these names can never be taken by a queue table, whatever
queues are created and in what order (``orders_uid`` is a fine queue name;
the unique index of ``orders`` is ``orders$uid``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from importlib.resources import files
from importlib.resources.abc import Traversable

_BLOCK = re.compile(r"^-- ([a-z_][a-z0-9_]*) --$", re.MULTILINE)
# {name} or {name(slot => value, ...)}, never {{...}} (a brace kept for str.format).
_USE = re.compile(r"(?<!\{)\{([a-z_][a-z0-9_]*)(?:\(([^()]*)\))?\}(?!\})")
_SLOT = re.compile(r"\{:([a-z_][a-z0-9_]*)\}")
_LONE_SLOT = re.compile(r"^[ \t]*\{:([a-z_][a-z0-9_]*)\}[ \t]*\n", re.MULTILINE)

# The names fill() puts in; a block cannot take one of them.
IDENTIFIERS = frozenset(
    {
        "schema",
        "queue",
        "ready_index",
        "group_index",
        "unique_index",
        "sequence_index",
        "done_index",
        "pkey",
        "id_seq",
        "id_seq_text",
        "saga",
        "saga_pkey",
        "unique_table",
        "unique_pkey",
        "subqueue_check",
        "unique_ids",
        "held",
        "segment",
        "lower",
        "upper",
        "opened",
    }
)


#: The names fill() puts in only for a queue: a block that uses one is run per queue.
QUEUE_IDENTIFIERS = IDENTIFIERS - {"schema", "segment", "lower", "upper", "opened"}


def names_a_queue(sql: str) -> bool:
    """Whether ``sql`` uses the name of a queue's table or of one of its objects."""
    return any("{" + name + "}" in sql for name in QUEUE_IDENTIFIERS)


@dataclass(frozen=True)
class Block:
    """One ``-- name --`` block as written: its text without comment lines, and its file."""

    name: str
    text: str
    path: str


def _sql_files(folder: Traversable, prefix: str = "") -> Iterator[tuple[str, str]]:
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.is_dir():
            yield from _sql_files(entry, f"{prefix}{entry.name}/")
        elif entry.name.endswith(".sql"):
            yield prefix + entry.name, entry.read_text(encoding="utf-8")


def read(package: str) -> dict[str, Block]:
    """The blocks of every ``.sql`` file in ``package``, as written; a name defined twice fails."""
    blocks: dict[str, Block] = {}
    for path, text in _sql_files(files(package)):
        parts = _BLOCK.split(text)
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in blocks:
                raise ValueError(
                    f"SQL block {name!r} is defined twice: in {blocks[name].path} and {path}"
                )
            if name in IDENTIFIERS:
                raise ValueError(f"SQL block {name!r} ({path}) takes the name of an identifier")
            lines = [line for line in body.strip().splitlines() if not line.startswith("--")]
            blocks[name] = Block(name, "\n".join(lines).strip(), path)
    return blocks


def _indent(text: str, prefix: str) -> str:
    return text.replace("\n", "\n" + prefix) if prefix else text


def _line_prefix(text: str, at: int) -> str:
    line = text[text.rfind("\n", 0, at) + 1 : at]
    return line[: len(line) - len(line.lstrip(" \t"))]


def _expand(
    name: str, blocks: dict[str, Block], given: dict[str, str], stack: tuple[str, ...]
) -> str:
    """Block ``name`` with the blocks it uses put in, its slots filled from ``given``."""
    where = " -> ".join((*stack, name))
    if name in stack:
        raise ValueError(f"SQL blocks use each other in a circle: {where}")
    text = blocks[name].text
    slots = set(_SLOT.findall(text))
    if slots != set(given):
        raise ValueError(f"SQL block {where} has slots {sorted(slots)}, given {sorted(given)}")

    def value(token: str) -> str:
        if token == "''":
            return ""
        if token in blocks:
            return _expand(token, blocks, {}, (*stack, name))
        return token

    def use(match: re.Match[str]) -> str:
        used, args = match[1], match[2]
        if used not in blocks:
            if args is None and used in IDENTIFIERS:
                return match[0]
            raise ValueError(f"SQL block {where}: {match[0]} names no block")
        bound: dict[str, str] = {}
        for arg in filter(str.strip, (args or "").split(",")):
            slot, arrow, token = (part.strip() for part in arg.partition("=>"))
            if not arrow or not slot or not token or slot in bound:
                raise ValueError(f"SQL block {where}: bad argument {arg.strip()!r} in {match[0]}")
            # {:slot} passes on what this block was given (the checks above saw it).
            passed = _SLOT.fullmatch(token)
            bound[slot] = given[passed[1]] if passed else token
        inner = _expand(used, blocks, bound, (*stack, name))
        return _indent(inner, _line_prefix(match.string, match.start()))

    values = {slot: value(token) for slot, token in given.items()}
    text = _USE.sub(use, text)
    text = _LONE_SLOT.sub(lambda m: m[0] if values[m[1]] else "", text)
    return _SLOT.sub(lambda m: _indent(values[m[1]], _line_prefix(m.string, m.start())), text)


def compose(blocks: dict[str, Block]) -> dict[str, str]:
    """Every block without slots, with the blocks it uses put in."""
    return {
        name: _expand(name, blocks, {}, ())
        for name, block in blocks.items()
        if not _SLOT.search(block.text)
    }


def load(package: str) -> dict[str, str]:
    """The blocks of every ``.sql`` file in ``package``, composed (see the module's docstring)."""
    return compose(read(package))


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

    Roles: ready, group, uid, seq, done, pkey, id_seq, saga, unique (and unique$pkey,
    unique$id), held (the records of held batches, dropped by schema 13), s<n> (segment n).
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
        values["group_index"] = quote_ident(own_name(queue, "group"))
        values["unique_index"] = quote_ident(own_name(queue, "uid"))
        values["sequence_index"] = quote_ident(own_name(queue, "seq"))
        values["done_index"] = quote_ident(own_name(queue, "done"))
        values["pkey"] = quote_ident(own_name(queue, "pkey"))
        values["id_seq"] = f"{quote_ident(schema)}.{quote_ident(own_name(queue, 'id_seq'))}"
        # The same name as a string literal, for nextval({id_seq_text}).
        values["id_seq_text"] = "'" + values["id_seq"].replace("'", "''") + "'"
        values["unique_table"] = f"{quote_ident(schema)}.{quote_ident(own_name(queue, 'unique'))}"
        values["unique_pkey"] = quote_ident(own_name(queue, "unique$pkey"))
        values["unique_ids"] = quote_ident(own_name(queue, "unique$id"))
        values["subqueue_check"] = quote_ident(own_name(queue, "subqueue"))
        values["held"] = f"{quote_ident(schema)}.{quote_ident(own_name(queue, 'held'))}"
        if "{saga" in sql:
            saga = own_name(queue, "saga")
            values["saga"] = f"{quote_ident(schema)}.{quote_ident(saga)}"
            values["saga_pkey"] = quote_ident(own_name(saga, "pkey"))
    return sql.format_map(values)


#: Segment n of a queue holds the ids from n * SEGMENT_SPAN up to (n + 1) * SEGMENT_SPAN
#: (segment 0 from the lowest bigint): 2**36 ids, more than any segment fills, and
#: room for 2**27 segments in a bigint.
SEGMENT_SPAN = 2**36


#: How a segment's comment says since when new rows go to it (segment_opened).
OPENED_NOTE = "nmbus: written from "


def segment_name(queue: str, number: int) -> str:
    """The table name of segment ``number`` of ``queue``: ``<queue>$s<number>``."""
    return own_name(queue, f"s{int(number)}")


@functools.lru_cache(maxsize=4096)
def render_segment(
    name: str, schema: str, queue: str, number: int, opened: datetime | None = None
) -> str:
    """The query ``name`` for segment ``number`` of ``queue``: {segment}, {lower}, {upper}.

    The bounds are integers computed here, and {opened} the literal of a
    timestamp formatted here (segment_opened), never text from outside.
    """
    number = int(number)
    if number < 0:
        raise ValueError(f"no segment {number}")
    sql = QUERIES[name]
    values = {
        "segment": f"{quote_ident(schema)}.{quote_ident(segment_name(queue, number))}",
        "lower": "MINVALUE" if number == 0 else str(number * SEGMENT_SPAN),
        "upper": str((number + 1) * SEGMENT_SPAN),
    }
    if opened is not None:
        values["opened"] = f"'{OPENED_NOTE}{opened.isoformat()}'"
    for key, value in values.items():
        sql = sql.replace("{" + key + "}", value)
    return fill(sql, schema, queue)


@functools.lru_cache(maxsize=1024)
def render(name: str, schema: str, queue: str | None = None) -> str:
    """The query ``name`` with identifiers for ``schema`` and ``queue`` filled in."""
    return fill(QUERIES[name], schema, queue)
