"""Names and limits: what a queue, a schema or a key may be, checked in one place.

Queue and schema names become PostgreSQL identifiers; keys (unique ids,
correlation ids, sequence and saga keys) become entries of btree indexes; any
text nmbus stores must be valid for a text column. The rules live here, below
the storage port, so that whatever needs them (the settings, the envelopes, a
handler's context, the command line) imports them without the port.

The longest delay, timeout or age nmbus accepts, ``MAX_SECONDS``, stays in
:mod:`nmbus.errors`: ``RetryLater`` checks it, and errors sit below this module.
"""

from __future__ import annotations

import re

from nmbus.errors import InvalidMessage, InvalidQueueName

# Checked with fullmatch: `$` would also match before a final "\n".
_QUEUE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_SCHEMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_QUEUE_NAME = 48
MAX_SCHEMA_NAME = 40
RESERVED_NAMES = frozenset({"schema_version", "queues", "subscriptions", "outbox"})

#: The longest key a message carries (unique_id, correlation_id) and the longest
#: saga key, in UTF-8 bytes. Each is a key of a btree index, which holds at most
#: about 2,700 bytes per entry, with room for what nmbus appends to one
#: (``<publish id>/<subscriber>``). A limit in characters would not do: 1,000
#: characters of 4 bytes each are 4,000 bytes.
MAX_KEY_BYTES = 1000
#: The longest sequence key, in UTF-8 bytes (it is a key of the sequence index).
MAX_SEQUENCE_KEY = 200


def validate_queue_name(name: object) -> str:
    """Return ``name`` if it can be a queue table name, else raise InvalidQueueName.

    Names are at most 48 characters (PostgreSQL truncates identifiers at 63
    bytes, and index names add a suffix), start with a letter or ``_`` and use
    letters, digits, ``_``, ``.`` and ``-``. They are still always quoted.
    """
    if not isinstance(name, str):
        raise InvalidQueueName(f"queue name must be a string, got {type(name).__name__}")
    if not name or len(name) > MAX_QUEUE_NAME or not _QUEUE_NAME.fullmatch(name):
        raise InvalidQueueName(
            f"invalid queue name {name!r}: use 1-{MAX_QUEUE_NAME} characters, letters, "
            "digits, '_', '.' or '-', starting with a letter or '_'"
        )
    if name in RESERVED_NAMES:
        raise InvalidQueueName(f"queue name {name!r} is reserved for nmbus's own tables")
    return name


def validate_schema_name(name: str) -> str:
    if not name or len(name) > MAX_SCHEMA_NAME or not _SCHEMA_NAME.fullmatch(name):
        raise InvalidQueueName(
            f"invalid schema name {name!r}: 1-{MAX_SCHEMA_NAME} characters, letters, digits and '_'"
        )
    return name


def check_text(what: str, text: str) -> None:
    """Refuse ``text`` that PostgreSQL cannot store in a text or jsonb column.

    The error message shows the bad character escaped: it must itself be storable,
    since a handler's error ends up in ``error_info``.
    """
    if "\x00" in text:
        raise InvalidMessage(
            f"{what} contains a NUL character (U+0000): PostgreSQL cannot store it"
        )
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError as exc:
            raise InvalidMessage(
                f"{what} contains a lone surrogate ({text[exc.start]!r}), which is not valid "
                "Unicode text: PostgreSQL cannot store it"
            ) from None


def utf8_size(text: str) -> int:
    """The size of ``text`` in UTF-8 bytes (without encoding ASCII text)."""
    return len(text) if text.isascii() else len(text.encode())


def check_key(what: str, value: object, limit: int = MAX_KEY_BYTES) -> str:
    """Refuse, with InvalidMessage, a key that is not a non-empty str PostgreSQL can
    store in an index: NUL, lone surrogates, over ``limit`` UTF-8 bytes."""
    if not isinstance(value, str) or not value:
        got = type(value).__name__ if not isinstance(value, str) else "''"
        raise InvalidMessage(f"{what} must be a non-empty string, got {got}")
    check_text(what, value)
    if len(value) * 4 > limit and (size := utf8_size(value)) > limit:
        raise InvalidMessage(
            f"{what} is {size} bytes as UTF-8, over the limit of {limit}; use a short key "
            "(an id, a hash)"
        )
    return value
