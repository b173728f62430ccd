"""What the dashboard reads from a request: page numbers, filters, ids and the
counts a confirmation carries; anything else is a 400 or 404."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime

from starlette.exceptions import HTTPException

from nmbus.ops.admin import FailedCount

# Text filters longer than this are refused rather than sent to the database.
MAX_FILTER = 500


def page_number(text: str | None) -> int:
    if not text:
        return 1
    if not text.isdigit() or len(text) > 6 or int(text) < 1:
        raise HTTPException(400, f"not a page number: {text[:40]!r}")
    return int(text)


def dump_counted(counts: Sequence[FailedCount]) -> str:
    """What a confirmation counted, for its form: per queue the count, highest id and time."""
    return json.dumps(
        [[c.queue, c.count, c.max_id, c.counted_at.isoformat()] for c in counts],
        ensure_ascii=True,
    )


def load_counted(text: str | None) -> list[FailedCount]:
    if not text:
        raise HTTPException(400, "refused: the form does not say what was confirmed (reload it)")
    try:
        found = []
        for queue, count, max_id, at in json.loads(text):
            when = datetime.fromisoformat(at)
            if (
                not isinstance(queue, str)
                or not isinstance(count, int)
                or not (max_id is None or (isinstance(max_id, int) and 0 <= max_id < 2**63))
                or when.tzinfo is None
            ):
                raise ValueError(queue)
            found.append(FailedCount(queue, count, max_id, when))
        return found
    except (ValueError, TypeError) as exc:
        raise HTTPException(400, "refused: the confirmation in the form is not valid") from exc


def filters(params: Mapping[str, str]) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for key in ("queue", "type", "error"):
        value = (params.get(key) or "").strip()
        if len(value) > MAX_FILTER:
            raise HTTPException(400, f"the {key} filter is longer than {MAX_FILTER} characters")
        if "\x00" in value:  # PostgreSQL text cannot hold it: nothing could match
            raise HTTPException(400, f"the {key} filter holds a NUL character")
        found[key] = value or None
    return found


def action(text: str) -> str:
    if text not in ("requeue", "purge"):
        raise HTTPException(404, "no such action")
    return text


def message_id(text: str) -> int:
    if not text.isdigit() or len(text) > 18:
        raise HTTPException(400, f"not a message id: {text[:40]!r}")
    return int(text)
