"""What the statistics job is asked to do: ``Options``, their checks, and ``StatsError``.

Every other module of the job reads an ``Options``; this one imports only the
standard library, so it sits at the bottom of the job's imports.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

# "second" suits short runs such as the demo's, which fit in one minute.
WINDOWS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}
# The default: the job picks one of WINDOWS from the data's time span.
AUTO_WINDOW = "auto"
DEFAULT_ACCURACY = 10_000
# How rows reach Spark: "jdbc" (partitioned reads by id, executors connect to
# PostgreSQL), "copy" (the driver exports them with COPY into Parquet files that
# Spark reads; no JDBC driver needed), or "auto": copy on a local master, else jdbc.
SOURCES = ("auto", "jdbc", "copy")


def _error_base() -> type[Exception]:
    """nmbus's ``ToolError`` when the job runs as ``nmbus.stats``, else ``Exception``.

    The job imports nothing of nmbus. Within nmbus, the package ``nmbus`` has
    loaded its error tree before any of its subpackages, so a StatsError joins
    it there (the CLI reports it as one of its own errors); shipped on its own
    (``nmbus_stats`` in the zip for ``--py-files``) it is a plain exception.
    """
    errors = sys.modules.get("nmbus.errors") if __name__.startswith("nmbus.") else None
    base: type[Exception] = getattr(errors, "ToolError", Exception)
    return base


if TYPE_CHECKING:
    _ErrorBase = Exception
else:
    _ErrorBase = _error_base()


class StatsError(_ErrorBase):
    """A problem the operator can fix; the message says how."""


@dataclass
class Options:
    """Everything the job needs; the command line and ``nmbus report`` build one."""

    dsn: str | None = field(repr=False)  # it may hold a password; None: the archive alone
    out: str = "nmbus-report"
    schema: str = "nmbus"
    window: str = AUTO_WINDOW
    since: datetime | None = None
    until: datetime | None = None
    partitions: int = 8
    archive_dir: str | None = None
    queues: list[str] = field(default_factory=list)
    accuracy: int = DEFAULT_ACCURACY
    top_errors: int = 10
    write_table: bool = False
    fetch_size: int = 10_000
    title: str = "nmbus report"
    source: str = "auto"
    copy_dir: str | None = None  # where "copy" stages its Parquet files (default: a temp dir)

    def validate(self) -> None:
        if not self.dsn and not self.archive_dir:
            raise StatsError("no database: pass --dsn postgresql://... or set NMBUS_DSN")
        if self.source not in SOURCES:
            raise StatsError(f"--source must be one of {', '.join(SOURCES)}, not {self.source!r}")
        if self.write_table and not self.dsn:
            raise StatsError("--write-table needs a database (--dsn)")
        if self.write_table and self.source == "copy":
            raise StatsError("--write-table writes through JDBC: use --source jdbc (or auto)")
        if self.window not in WINDOWS and self.window != AUTO_WINDOW:
            raise StatsError(
                f"--window must be {AUTO_WINDOW} or one of {', '.join(WINDOWS)}, "
                f"not {self.window!r}"
            )
        if self.partitions < 1:
            raise StatsError("--partitions must be at least 1")
        if not 100 <= self.accuracy <= 10_000_000:
            raise StatsError("--accuracy must be between 100 and 10000000")
        if self.since and self.until and self.since >= self.until:
            raise StatsError("--since must be before --until")
        if not self.schema.replace("_", "a").isalnum():
            raise StatsError(f"invalid schema name {self.schema!r}")


def parse_time(text: str) -> datetime:
    """An ISO 8601 time (naive means UTC), or a span back from now such as 2h, 30m, 7d."""
    text = text.strip()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    if text and text[-1] in units and text[:-1].replace(".", "", 1).isdigit():
        return datetime.now(UTC) - timedelta(seconds=float(text[:-1]) * units[text[-1]])
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise StatsError(
            f"cannot read time {text!r}: use ISO 8601 (2024-05-01T12:00) or a span (2h, 7d)"
        ) from exc
    return value if value.tzinfo else value.replace(tzinfo=UTC)
