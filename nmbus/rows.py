"""The row of a queue table, written down once.

:class:`QueueRow` lists every column of a queue table, in table order, with
its Python type; :data:`COLUMNS` is their names. Everything else that holds a
whole row takes its columns from here, by name: the in-memory store's rows
(``nmbus.testing.Row`` is this class), the operator's
:class:`nmbus.ports.operations.MessageRow` (a QueueRow with the lengths of its texts)
and retention's Parquet archive (``nmbus.postgres.retention``). The table's
DDL is the ``create_queue`` block of the SQL; ``tests/test_rows.py`` compares
this list with the columns PostgreSQL's catalogue gives for a real table.

A claimed message (:class:`nmbus.messages.StoredMessage`) carries some of
these columns, under the same names.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime


@dataclass(frozen=True, slots=True)
class QueueRow:
    """Every column of one row of a queue table; the headers as JSON text.

    Where a message is (``subqueue``): I ready, R scheduled, X processed, F
    failed. A row being handled stays in I or R with ``handling_client_id``
    and ``lease_expires`` set.
    """

    id: int
    from_endpoint: str
    to_endpoint: str
    subqueue: str
    insert_time: datetime
    last_processed: datetime | None
    retry_count: int
    retry_time: datetime
    error_info: str | None
    correlation_id: str | None
    label: str | None
    msg_text: str | None
    msg_headers: str | None
    unique_id: str
    handling_client_id: str | None = None
    lease_expires: datetime | None = None
    isolated: bool = False
    priority: int = 0
    sequence_key: str | None = None
    expires_at: datetime | None = None


#: The names of a queue table's columns, in table order.
COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(QueueRow))
