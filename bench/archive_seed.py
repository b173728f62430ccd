"""Write a synthetic retention archive: Parquet files as ``nmbus.postgres.retention`` writes them.

    python -m bench.archive_seed --out /tmp/nmbus-archive --rows 10000000

Layout and columns are retention's own (``<out>/queue=<q>/day=<YYYY-MM-DD>/*.parquet``,
``nmbus.postgres.retention.archive_schema()``), so the statistics job reads the result
exactly as it reads a real archive, with no database at all
(``nmbus report --archive-dir <out>``). Rows are spread over ``--queues`` and
``--days``; one in 16 failed (``F``, with an error), one in 5 processed rows
needed a retry; latencies vary with the id. Generated column-wise by pyarrow,
no Python loop per row.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from nmbus.postgres.retention import archive_schema, partition_dir

LABELS = ("shop.OrderPlaced", "billing.ChargeCard", "mail.SendReceipt", "stock.Reserve")
ERRORS = (
    "TimeoutError: payment gateway did not answer\nTraceback (most recent call last):",
    "ValueError: card declined\nTraceback (most recent call last):",
    "KeyError: 'customer_id'\nTraceback (most recent call last):",
)
START = datetime(2026, 1, 1, tzinfo=UTC)
DAY_US = 86_400_000_000


def _part(queue: str, day: int, first_id: int, rows: int) -> Any:
    """One file's rows: ids first_id.., spread over one UTC day."""
    import pyarrow as pa
    import pyarrow.compute as pc

    schema = archive_schema()
    ids = pa.array(range(first_id, first_id + rows), type=pa.int64())
    step = max(1, DAY_US // max(rows, 1))
    day_start = int((START + timedelta(days=day)).timestamp()) * 1_000_000
    offsets = pc.multiply(pc.subtract(ids, first_id), step)
    insert_us = pc.add(offsets, day_start)
    # ready after a 0-6 s deferral for some, handled 1-1000 ms after ready; spikes every 97.
    ready_us = pc.add(insert_us, pc.multiply(pc.bit_wise_and(ids, 7), 750_000))
    handle_ms = pc.add(pc.divide(pc.bit_wise_and(pc.multiply(ids, 37), 1023), 1), 1)
    spike = pc.if_else(pc.equal(pc.bit_wise_and(ids, 127), 97), 4_000_000, 0)
    done_us = pc.add(pc.add(ready_us, pc.multiply(handle_ms, 1000)), spike)
    failed = pc.equal(pc.bit_wise_and(ids, 15), 3)
    retried = pc.equal(pc.bit_wise_and(ids, 7), 5)
    ts = pa.timestamp("us", tz="UTC")
    idx = pc.bit_wise_and(ids, 3)
    labels = pa.array(LABELS).take(idx)
    errors = pa.array(ERRORS).take(pc.bit_wise_and(pc.shift_right(ids, 4), 1))
    no_error = pa.nulls(rows, pa.string())
    columns = {
        "id": ids,
        "from_endpoint": pa.repeat("orders", rows),
        "to_endpoint": pa.repeat(queue, rows),
        "subqueue": pc.if_else(failed, "F", "X"),
        "insert_time": insert_us.cast(ts),
        "last_processed": done_us.cast(ts),
        "retry_count": pc.if_else(failed, 5, pc.if_else(retried, 2, 1)).cast(pa.int32()),
        "retry_time": ready_us.cast(ts),
        "error_info": pc.if_else(failed, errors, pc.if_else(retried, errors, no_error)),
        "correlation_id": pa.nulls(rows, pa.string()),
        "label": labels,
        "msg_text": pa.repeat('{"order_id": 1, "amount": 9.5}', rows),
        "msg_headers": pa.repeat("{}", rows),
        "unique_id": pc.binary_join_element_wise(queue, ids.cast(pa.string()), "-"),
        "handling_client_id": pa.nulls(rows, pa.string()),
        "lease_expires": pa.nulls(rows, ts),
        "isolated": pa.repeat(False, rows),
        "priority": pa.repeat(pa.scalar(0, pa.int16()), rows),
        "sequence_key": pa.nulls(rows, pa.string()),
        "expires_at": pa.nulls(rows, ts),
    }
    return pa.Table.from_pydict(columns, schema=schema)


def write_archive(out: Path, rows: int, queues: list[str], days: int) -> list[Path]:
    """``rows`` rows over ``queues`` x ``days`` files; returns the files written."""
    import pyarrow.parquet as pq

    files = []
    cells = [(q, d) for q in queues for d in range(days)]
    per, extra = divmod(rows, len(cells))
    next_id = {q: 1 for q in queues}
    for i, (queue, day) in enumerate(cells):
        n = per + (1 if i < extra else 0)
        if not n:
            continue
        folder = partition_dir(out, queue, (START + timedelta(days=day)).date().isoformat())
        folder.mkdir(parents=True, exist_ok=True)
        first = next_id[queue]
        path = folder / f"part-{first}-{first + n - 1}.parquet"
        pq.write_table(_part(queue, day, first, n), path, row_group_size=1 << 20)
        next_id[queue] = first + n
        files.append(path)
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.archive_seed", description=__doc__)
    p.add_argument("--out", required=True, type=Path, help="archive folder (made if missing)")
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--queues", default="billing,warehouse,notifications")
    p.add_argument("--days", type=int, default=7)
    args = p.parse_args(argv)
    queues = [q for q in args.queues.split(",") if q]
    if args.rows < 1 or args.days < 1 or not queues:
        print("archive_seed: --rows, --days and --queues must not be empty", file=sys.stderr)
        return 2
    files = write_archive(args.out, args.rows, queues, args.days)
    size = sum(f.stat().st_size for f in files)
    print(f"{args.rows:,} rows in {len(files)} files, {size / 1e6:.1f} MB under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
