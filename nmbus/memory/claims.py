"""What the in-memory store decides of a row as it claims or cancels it: the claim's
``recovered`` (nmbus/postgres/sql/runtime.sql), the heads of sequences, and what
cancel_unique and cancel_correlated do."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

from nmbus.delivery.cancellation import Cancel
from nmbus.messages import StoredMessage
from nmbus.rows import QueueRow


def recovery(row: QueueRow) -> int:
    """As the claim query's ``recovered``: 0 fresh, 1 let go to be tried alone, 2/3 crashed."""
    if row.lease_expires is None:
        return 0
    if row.handling_client_id is None:
        return 1
    return 3 if row.isolated else 2


def cancel_rows(table: dict[int, QueueRow], request: Cancel) -> int:
    """Move the rows of ``table`` that ``request`` names and no worker holds to F."""
    now = datetime.now(UTC)
    picked = [
        row.id
        for row in table.values()
        if row.subqueue in ("I", "R")
        and (row.lease_expires is None or row.lease_expires < now)
        and (
            row.unique_id == request.unique_id
            if request.unique_id is not None
            else row.correlation_id == request.correlation_id
        )
    ]
    for row_id in picked:
        table[row_id] = replace(
            table[row_id],
            subqueue="F",
            error_info=request.reason,
            last_processed=now,
            handling_client_id=None,
            lease_expires=None,
        )
    return len(picked)


def claimed_message(row: QueueRow, recovered: int, now: datetime) -> StoredMessage:
    """What a claim returns of ``row`` (already claimed): the message, as PostgreSQL's."""
    return StoredMessage(
        id=row.id,
        from_endpoint=row.from_endpoint,
        insert_time=row.insert_time,
        retry_count=row.retry_count,
        retry_time=row.retry_time,
        correlation_id=row.correlation_id,
        label=row.label,
        msg_text=row.msg_text,
        msg_headers=row.msg_headers,
        unique_id=row.unique_id,
        recovered=recovered,
        priority=row.priority,
        expired=row.expires_at is not None and row.expires_at <= now,
        claim=row.handling_client_id or "",
    )


def sequence_heads(table: dict[int, QueueRow]) -> set[int]:
    """Ids of the members that may run: the lowest not in X of each sequence (see `claim`)."""
    seen: set[str] = set()
    heads: set[int] = set()
    for r in sorted(table.values(), key=lambda r: r.id):
        if r.sequence_key is not None and r.subqueue != "X":
            if r.sequence_key not in seen:
                heads.add(r.id)
            seen.add(r.sequence_key)
    return heads
