"""A DSN that reaches only a hot standby is refused at start, with the way out.

Against a real streaming standby (tests/standby.py): a worker Bus, a send-only
Bus and the operations (Admin, the command line), whether the queue already
exists there (replicated from the primary) or not. Before, a Bus whose queue
existed started (installing a current schema writes nothing) and failed later
at every claim and send.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import asyncpg
import pytest
from typer.testing import CliRunner

from nmbus import Bus, DatabaseUnavailable, InvalidSetting
from nmbus.cli import app
from nmbus.ops.admin import Admin
from tests.messages import Ping
from tests.standby import Pair, replicated
from tests.waits import wait_until

pytestmark = pytest.mark.reliability

SECRET = "s3cretPW"  # trust authentication: the password is never checked, only hidden


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    with replicated(synchronous=False) as started:
        yield started


@pytest.fixture(scope="module")
def standby_only(pair: Pair) -> str:
    """The standby's DSN, once the queue "billing" made on the primary is replayed there."""

    async def make() -> None:
        async with Bus("billing", dsn=pair.dsn(pair.primary), concurrency=0):
            pass
        conn = await asyncpg.connect(pair.dsn(pair.standby, read_write=False))
        try:
            await wait_until(
                "SELECT count(*) FROM pg_tables WHERE schemaname = 'nmbus' "
                "AND tablename = 'billing'",
                db=conn,
                what="the queue replayed on the standby",
            )
        finally:
            await conn.close()

    asyncio.run(make())
    dsn = pair.dsn(pair.standby, read_write=False)
    return dsn.replace("postgres@", f"postgres:{SECRET}@")


def _says_read_only(exc: BaseException) -> None:
    text = str(exc)
    for needle in ("read-only", "hot standby", "primary", "target_session_attrs=read-write"):
        assert needle in text, (needle, text)
    assert SECRET not in text
    assert len(text.splitlines()) == 1


async def _client_sessions(pair: Pair) -> int:
    """Sessions on the standby other than the one asking."""
    conn = await asyncpg.connect(pair.dsn(pair.standby, read_write=False))
    try:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
                "AND pid <> pg_backend_pid()"
            )
        )
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("endpoint", "concurrency"),
    [("billing", 2), ("fresh", 2), ("billing", 0), ("fresh", 0)],
    ids=["worker-existing-queue", "worker-new-queue", "send-only-existing", "send-only-new"],
)
async def test_a_bus_on_a_standby_is_refused_at_start(
    pair: Pair, standby_only: str, endpoint: str, concurrency: int
) -> None:
    bus = Bus(endpoint, dsn=standby_only, concurrency=concurrency)
    with pytest.raises(InvalidSetting) as refused:
        await bus.start()
    _says_read_only(refused.value)
    # Nothing of it stays behind: its pool was closed with the refusal.
    assert await _client_sessions(pair) == 0
    with pytest.raises(RuntimeError, match="not open"):
        await bus.send(Ping(n=1), to="billing")


async def test_admin_on_a_standby_is_refused_at_first_use(pair: Pair, standby_only: str) -> None:
    async with Admin(standby_only) as admin:
        with pytest.raises(InvalidSetting) as refused:
            await admin.list_queues()
    _says_read_only(refused.value)
    assert await _client_sessions(pair) == 0


@pytest.mark.parametrize("argv", [["status"], ["queues", "create", "other"]])
def test_the_command_line_on_a_standby_is_one_line_and_exit_2(
    standby_only: str, argv: list[str]
) -> None:
    result = CliRunner().invoke(app, [*argv, "--dsn", standby_only], env={"COLUMNS": "80"})
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in ("read-only", "hot standby", "primary", "target_session_attrs=read-write"):
        assert needle in lines[0], (needle, lines[0])
    assert SECRET not in result.stderr


async def test_read_write_over_standbys_only_is_unavailable_not_a_driver_error(
    pair: Pair, standby_only: str
) -> None:
    # target_session_attrs=read-write naming only a standby: during a failover,
    # before the promotion, that is what every reconnection meets.
    only = pair.dsn(pair.standby, pair.standby)
    for opening in (
        lambda: Bus("billing", dsn=only).start(),
        lambda: Admin(only).list_queues(),
    ):
        with pytest.raises(DatabaseUnavailable) as refused:
            await opening()
        assert "no server of the DSN takes writes" in str(refused.value), refused.value


async def test_read_write_naming_the_standby_first_reaches_the_primary(
    pair: Pair, standby_only: str
) -> None:
    dsn = pair.dsn(pair.standby, pair.primary)
    async with Bus("billing", dsn=dsn, concurrency=0) as bus:
        await bus.send(Ping(n=7), to="billing")
    conn = await asyncpg.connect(pair.dsn(pair.primary))
    try:
        assert await conn.fetchval("SELECT count(*) FROM nmbus.billing") == 1
    finally:
        await conn.close()


async def test_a_database_read_only_by_default_is_refused(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            f'ALTER DATABASE "{await conn.fetchval("SELECT current_database()")}" '
            "SET default_transaction_read_only = on"
        )
    finally:
        await conn.close()
    with pytest.raises(InvalidSetting, match="default_transaction_read_only is on"):
        await Bus("billing", dsn=dsn).start()
    # The operations read there (a viewer's access); tests/test_admin_guards.py
    # shows that their writes then fail with the server's own error.
    async with Admin(dsn) as admin:
        assert await admin.list_queues() == []
