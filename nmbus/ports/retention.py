"""What retention removes and what one run did: the policy and the result.

Shared by the stores (nmbus.postgres.retention, the memory store) and the
operator's layer (nmbus.ports.operations, nmbus.ops.admin).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from nmbus.settings import SEGMENT_SECONDS

if TYPE_CHECKING:
    from nmbus.settings import Settings


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """What to remove and how: ages, batch size, and where to archive (None: don't)."""

    max_age: timedelta = timedelta(days=7)
    failed_max_age: timedelta | None = None
    batch_size: int = 5000
    archive_dir: Path | None = None
    #: The span of time one segment covers (docs/storage.md, "Segments").
    segment_seconds: float = 3600.0
    #: The claim check's store (an fsspec URL), whose orphan files retention removes.
    claim_check_store: str | None = None

    def __post_init__(self) -> None:
        low, high = SEGMENT_SECONDS
        if not low <= self.segment_seconds <= high:
            raise ValueError("segment_seconds must be from 1 second to 31 days")
        if self.max_age < timedelta(0):
            raise ValueError("max_age must not be negative")
        if self.failed_max_age is not None and self.failed_max_age < timedelta(0):
            raise ValueError("failed_max_age must not be negative")
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")

    @classmethod
    def from_settings(cls, settings: Settings) -> RetentionPolicy:
        archive = settings.retention_archive_dir
        return cls(
            max_age=settings.retention_max_age,
            failed_max_age=settings.retention_failed_max_age,
            batch_size=settings.retention_batch_size,
            archive_dir=Path(archive) if archive else None,
            segment_seconds=settings.segment_seconds,
            claim_check_store=settings.claim_check_store,
        )


@dataclass(slots=True)
class RetentionResult:
    """What one run did to one queue."""

    queue: str
    deleted: dict[str, int] = field(default_factory=lambda: {"X": 0, "F": 0})
    files: list[Path] = field(default_factory=list)
    batches: int = 0
    longest_batch_seconds: float = 0.0
    recovered_files: int = 0
    skipped: bool = False
    #: Segments dropped whole, rows moved out of old segments to the one being
    #: written (waiting F/I/R rows), and segments kept because of what they hold.
    segments_dropped: int = 0
    rows_moved: int = 0
    segments_pinned: int = 0
    #: The bytes the dropped segments took on disk (indexes included), given back to
    #: the system; rows deleted one by one give none back (vacuum makes their space
    #: reusable inside the table), so they are not counted.
    bytes_freed: int = 0
    #: Payloads stored apart (the claim check) deleted with their messages, and
    #: orphan files of its store (a sender died before its commit) deleted.
    payloads_deleted: int = 0
    orphans_deleted: int = 0

    @property
    def total(self) -> int:
        return sum(self.deleted.values())


#: Called as ``on_batch(queue, rows)`` after every committed batch of a change.
ProgressCallback = Callable[[str, int], None]
