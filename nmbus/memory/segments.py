"""The in-memory store's segments: its tables are not partitioned, so each is one segment.

What ``ops_queue_segments`` and ``ops_segment_probe`` read of a PostgreSQL
queue table that is not partitioned, on a dict of rows: segment 0, holding
every row. Rows are counted, not estimated; a dict has no size on disk (0).
"""

from __future__ import annotations

from nmbus.ports.operations import SegmentInfo
from nmbus.rows import QueueRow


def whole_table(queue: str, table: dict[int, QueueRow]) -> SegmentInfo:
    """``queue``'s one segment, named as its table."""
    first = table[min(table)] if table else None
    last = table[max(table)] if table else None
    return SegmentInfo(
        queue,
        queue,
        0,
        rows=len(table),
        pending=sum(1 for r in table.values() if r.subqueue != "X"),
        oldest=first.insert_time if first else None,
        newest=last.insert_time if last else None,
        size_bytes=0,
    )
