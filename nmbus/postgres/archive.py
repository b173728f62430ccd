"""The retention archive: Parquet files of removed rows, written pending, then published.

Layout, as the statistics job reads it::

    <archive_dir>/queue=<name>/day=<YYYY-MM-DD>/<part>.parquet

(``day`` is the UTC day of ``last_processed``; columns are exactly the queue
table's, ``msg_headers`` as JSON text, timestamps as UTC timestamps.) A file
is written hidden (``.pending-<part>.parquet``) and synced, the rows it holds
are removed in a transaction, and only then is it renamed to its visible
name (nmbus.postgres.retention has the whole protocol and its recovery).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from datetime import UTC
from pathlib import Path
from typing import Any

from nmbus.errors import RetentionError
from nmbus.rows import COLUMNS

# The queue table's columns, in table order: the archive holds exactly these.
ARCHIVE_COLUMNS: tuple[str, ...] = COLUMNS
_TIMESTAMPS = frozenset(
    {"insert_time", "last_processed", "retry_time", "lease_expires", "expires_at"}
)
PENDING = ".pending-"


def archive_schema() -> Any:
    """The pyarrow schema of archive files: the queue table's columns and types."""
    import pyarrow as pa

    ts = pa.timestamp("us", tz="UTC")
    types = {
        "id": pa.int64(),
        "retry_count": pa.int32(),
        "isolated": pa.bool_(),
        "priority": pa.int16(),
        **{name: ts for name in _TIMESTAMPS},
    }
    return pa.schema([(name, types.get(name, pa.string())) for name in ARCHIVE_COLUMNS])


def partition_dir(archive_dir: Path, queue: str, day: str) -> Path:
    return archive_dir / f"queue={queue}" / f"day={day}"


def write_pending(archive_dir: Path, queue: str, rows: Sequence[Any]) -> list[Path]:
    """Write ``rows`` as hidden pending files, one per UTC day, durable on return."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise RetentionError("archiving needs pyarrow: pip install 'nmbus[archive]'") from exc
    by_day: dict[str, list[Any]] = {}
    for row in rows:
        day = row["last_processed"].astimezone(UTC).date().isoformat()
        by_day.setdefault(day, []).append(row)
    schema = archive_schema()
    written: list[Path] = []
    try:
        for day, day_rows in sorted(by_day.items()):
            folder = partition_dir(archive_dir, queue, day)
            folder.mkdir(parents=True, exist_ok=True)
            part = f"part-{day_rows[0]['id']}-{day_rows[-1]['id']}-{uuid.uuid4().hex[:8]}"
            path = folder / f"{PENDING}{part}.parquet"
            table = pa.Table.from_pydict(
                {name: [r[name] for r in day_rows] for name in ARCHIVE_COLUMNS}, schema=schema
            )
            # Listed before it is written: a write that fails leaves no half file.
            written.append(path)
            with open(path, "wb") as f:
                pq.write_table(table, f)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(folder)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return written


def publish(pending: Sequence[Path]) -> list[Path]:
    """Rename committed pending files to their visible names, durably."""
    final: list[Path] = []
    for path in pending:
        target = path.with_name(path.name.removeprefix(PENDING))
        os.replace(path, target)
        _fsync_dir(target.parent)
        final.append(target)
    return final


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pending_ids(path: Path) -> list[int] | None:
    """The ids a pending file holds; None when it is not a whole Parquet file.

    A Parquet file is whole only once its footer, written last, is there: a
    file the writer was killed in (empty, or cut short) has none.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, columns=["id"])
    except pa.ArrowInvalid:
        return None
    return [int(i) for i in table.column("id").to_pylist()]
