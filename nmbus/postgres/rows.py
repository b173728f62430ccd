"""The queue table's row on the wire: statement arguments and results, by column name.

The columns are :data:`nmbus.rows.COLUMNS`. A send gives a new row the
columns of :data:`SENT`, one array per column (``insert_messages``,
``outbox_insert`` and the publish function take them so), whether they come
from envelopes or from the outbox's rows; a claim returns the columns of
:class:`nmbus.messages.StoredMessage`, under its field names, checked here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from nmbus.messages import Envelope, StoredMessage
from nmbus.postgres.sql import render

#: What a claim returns, in this order: StoredMessage's fields.
CLAIMED: tuple[str, ...] = tuple(f.name for f in fields(StoredMessage))
_WIDTH = len(CLAIMED)


def envelope_arrays(envelopes: Sequence[Envelope]) -> dict[str, list[Any]]:
    """The columns a sender gives each new row, one array per column, in envelope order.

    ``deliver_at`` is no column: it decides ``subqueue`` and ``retry_time``.
    Written out column by column: a comprehension per column is what a send
    cost before (a getter called per value is twice as slow on 100 envelopes).
    """
    return {
        "deliver_at": [e.deliver_at for e in envelopes],
        "correlation_id": [e.correlation_id for e in envelopes],
        "label": [e.label for e in envelopes],
        "msg_text": [e.msg_text for e in envelopes],
        "msg_headers": [e.msg_headers for e in envelopes],
        "unique_id": [e.unique_id for e in envelopes],
        "priority": [e.priority for e in envelopes],
        "sequence_key": [e.sequence for e in envelopes],
        "expires_at": [e.expires_at for e in envelopes],
    }


#: The names of the columns a sender gives (``deliver_at`` and columns of the queue table).
SENT: tuple[str, ...] = tuple(envelope_arrays(()))


def outbox_arrays(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """The sent columns of outbox rows (``outbox_take``), one array per column."""
    return {column: [r[column] for r in rows] for column in SENT}


def insert_sql(schema: str, queue: str, rows: int) -> str:
    """The statement that inserts ``rows`` messages into ``queue``: ``insert_messages``
    for one, ``insert_messages_sorted`` for more (in unique_id order, so that two
    senders of the same unique_ids cannot deadlock; a single send pays nothing)."""
    return render("insert_messages" if rows == 1 else "insert_messages_sorted", schema, queue)


def insert_args(
    from_endpoint: str, queue: str, arrays: Mapping[str, list[Any]], channel: str
) -> tuple[Any, ...]:
    """The parameters $1..$12 of ``insert_messages`` (and ``outbox_insert``)."""
    return (
        from_endpoint,
        queue,
        arrays["deliver_at"],
        arrays["correlation_id"],
        arrays["label"],
        arrays["msg_text"],
        arrays["msg_headers"],
        arrays["unique_id"],
        channel,
        arrays["priority"],
        arrays["sequence_key"],
        arrays["expires_at"],
    )


def claimed(rows: Sequence[Any]) -> list[StoredMessage]:
    """The messages of a claim's rows, highest priority first, then by ready time.

    A row whose ``id`` is NULL stands for no message (``finish_claim`` returns
    one when it claims nothing). The names of the rows' columns are checked
    once per call, so each message is then built from a slice of its row (no
    lookup by name per row: this is the claim's hot path).
    """
    if not rows:
        return []
    names = tuple(rows[0].keys())[:_WIDTH]
    if names != CLAIMED:
        raise RuntimeError(f"a claim returned the columns {names}, expected {CLAIMED}")
    messages = [StoredMessage(*r[:_WIDTH]) for r in rows if r[0] is not None]
    messages.sort(key=_claim_order)
    return messages


def _claim_order(message: StoredMessage) -> tuple[int, Any, int]:
    return (-message.priority, message.retry_time, message.id)
