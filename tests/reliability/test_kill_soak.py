"""The kill soak: 20k messages, flaky handlers, a worker SIGKILLed every few seconds."""

from __future__ import annotations

import asyncpg
import pytest

from bench.soak import run_soak

pytestmark = pytest.mark.reliability


@pytest.mark.timeout(400)
async def test_kill_soak_loses_nothing_and_repeats_only_killed_attempts(
    dsn: str, db: asyncpg.Connection
) -> None:
    report = await run_soak(dsn, 20_000, workers=2, kill_every=1.5, poison=2, timeout=300)
    print("kill soak:", report.as_dict())

    assert report.kills >= 3  # the run really lived through several SIGKILLs
    assert report.injected_failures > 1000  # and ~10% of handler runs failing
    assert report.lost == 0 and report.open == 0
    # Two poison messages killed their workers until they ended in F; nothing else did.
    assert report.deaths >= 2
    assert report.poison_failed == 2 and report.innocent_exhausted == 0
    assert report.processed + report.failed == 20_000
    # A failed message may only be one whose attempts all failed or died.
    assert set(report.failed_reasons) <= {"SoakFailure", "AttemptsExhausted"}
    assert report.effects_duplicated == 0
    assert report.effects_missing == 0
    assert report.effects_in_failed == 0
    assert report.repeats_from_live == 0
    assert report.handled_twice <= report.repeats_from_killed
    assert report.ok

    # Independently of the report: the table itself.
    by_subqueue = dict(
        await db.fetch("SELECT subqueue, count(*) FROM nmbus_soak.soak GROUP BY subqueue")
    )
    assert set(by_subqueue) <= {"X", "F"}
    assert sum(by_subqueue.values()) == 20_000
    assert (
        await db.fetchval(
            "SELECT count(*) FROM nmbus_soak.soak WHERE handling_client_id IS NOT NULL "
            "OR lease_expires IS NOT NULL"
        )
        == 0
    )
    duplicated = await db.fetchval(
        "SELECT count(*) FROM (SELECT unique_id FROM nmbus_soak.soak_effects "
        "GROUP BY unique_id HAVING count(*) > 1) d"
    )
    assert duplicated == 0
