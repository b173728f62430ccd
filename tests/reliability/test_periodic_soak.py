"""Periodic ticks through SIGKILLs and retention: each due time enqueued once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.periodic_soak import soak

pytestmark = pytest.mark.reliability


@pytest.mark.timeout(120)
async def test_no_due_time_is_enqueued_twice_through_kills_and_retention(
    dsn: str, tmp_path: Path
) -> None:
    result = await soak(dsn, seconds=16, kills=2, archive=tmp_path)
    print("periodic soak:", result)
    assert result.kills == 2
    assert result.archived > 0  # retention really removed handled ticks as it went
    assert result.due_times > 0
    # Every tick row ever stored, archived or live, has its own due time.
    assert result.enqueued_twice == []
    assert result.rows == result.due_times
