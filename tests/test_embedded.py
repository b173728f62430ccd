"""The embedded PostgreSQL: a real start, real TCP connections, a real stop.

One server per module (initdb costs a few seconds); the tests run in order
and each leaves it in a state the next one describes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from nmbus.demo.embedded import EmbeddedPostgres, _bin_dir
from tests.waits import wait_until

pytest.importorskip("pgserver", reason="the embedded extra (pgserver) is not installed")

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres(tmp_path_factory.mktemp("embedded") / ".nmbus")
    try:
        yield server
    finally:
        server.destroy()
        assert server.running() is None


async def _fetch(dsn: str, query: str) -> object:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        return await conn.fetchval(query)
    finally:
        await conn.close()


def _version(dsn: str) -> str:
    addr = asyncio.run(_fetch(dsn, "SELECT inet_server_addr()::text"))
    assert isinstance(addr, str) and addr.startswith("127.0.0.1"), "not a TCP connection"
    return str(asyncio.run(_fetch(dsn, "SHOW server_version")))


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _wait_gone(pid: int) -> None:
    asyncio.run(wait_until(lambda: _gone(pid), interval=0.1, what=f"process {pid} to end"))


def test_start_listens_on_tcp_and_is_reused(embedded: EmbeddedPostgres) -> None:
    dsn = embedded.start()
    assert dsn.startswith("postgresql://postgres@127.0.0.1:")
    assert _version(dsn).startswith("16.")
    first = embedded.running()
    assert first is not None and first.on_tcp
    # A second start (a second demo run) reuses the same server, same port.
    assert embedded.start() == dsn
    again = embedded.running()
    assert again is not None and again.pid == first.pid
    assert embedded.status() == dsn


def test_stop_is_idempotent_and_data_survives(embedded: EmbeddedPostgres) -> None:
    dsn = embedded.start()
    asyncio.run(_fetch(dsn, "CREATE TABLE IF NOT EXISTS kept (n int)"))
    asyncio.run(_fetch(dsn, "INSERT INTO kept VALUES (7)"))
    found = embedded.running()
    assert found is not None
    assert embedded.stop() is True
    _wait_gone(found.pid)
    assert embedded.running() is None
    assert not (embedded.pgdata / "postmaster.pid").exists()
    assert embedded.stop() is False
    with pytest.raises(OSError):
        asyncio.run(_fetch(dsn, "SELECT 1"))
    # Started again, it prefers its previous port and keeps its data.
    assert embedded.start() == dsn
    assert asyncio.run(_fetch(dsn, "SELECT sum(n) FROM kept")) == 7


def test_killed_server_leaves_a_stale_pid_file_that_start_handles(
    embedded: EmbeddedPostgres,
) -> None:
    embedded.start()
    found = embedded.running()
    assert found is not None
    os.kill(found.pid, signal.SIGKILL)
    _wait_gone(found.pid)
    assert (embedded.pgdata / "postmaster.pid").exists()
    assert embedded.running() is None
    dsn = embedded.start()
    assert _version(dsn).startswith("16.")


def test_pid_file_naming_a_live_foreign_process_is_stale(
    embedded: EmbeddedPostgres,
) -> None:
    embedded.stop()
    # After a reboot the recorded pid may belong to any process: here a sleep.
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        pid_file = embedded.pgdata / "postmaster.pid"
        pid_file.write_text(f"{sleeper.pid}\n{embedded.pgdata}\n0\n5432\n\n127.0.0.1\n0 0\nready\n")
        assert embedded.running() is None
        dsn = embedded.start()
        assert _version(dsn).startswith("16.")
    finally:
        sleeper.kill()
        sleeper.wait()


def test_socket_only_server_is_restarted_on_tcp(embedded: EmbeddedPostgres) -> None:
    # What pgserver's own get_server() leaves behind: a server with no TCP listener.
    embedded.stop()
    socket_dir = embedded.pgdata
    args = [
        str(_bin_dir() / "pg_ctl"),
        "-D",
        str(embedded.pgdata),
        "-l",
        str(embedded.log_file),
        "-w",
        "-o",
        f"-h '' -k {socket_dir}",
        "start",
    ]
    user = {"user": "pgserver"} if os.geteuid() == 0 else {}
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, timeout=60, **user)  # type: ignore[call-overload]
    socket_only = embedded.running()
    assert socket_only is not None and not socket_only.on_tcp
    assert embedded.status() is None
    dsn = embedded.start()
    assert _version(dsn).startswith("16.")
    _wait_gone(socket_only.pid)


def test_missing_pgserver_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import importlib.util

    from nmbus.demo.embedded import EmbeddedUnavailable

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "pgserver" else real(name, *a),
    )
    with pytest.raises(EmbeddedUnavailable, match=r"pip install 'nmbus\[embedded\]'"):
        EmbeddedPostgres(tmp_path).start()


def test_as_root_the_hand_over_says_what_it_changed(tmp_path: Path) -> None:
    import pwd

    from nmbus.demo import embedded_root

    if os.geteuid() != 0:
        pytest.skip("only root hands the data folder over to a system user")
    user = f"nmbus-t{os.getpid()}"
    pgdata, install = tmp_path / "pgdata", tmp_path / "pginstall"
    pgdata.mkdir()
    (install / "bin").mkdir(parents=True)
    (install / "bin" / "postgres").write_text("#!/bin/sh\n")
    (install / "bin" / "postgres").chmod(0o700)
    try:
        said = embedded_root.hand_over(user, pgdata, install)
        assert said[0] == f"created the system user {user} (useradd --system)"
        assert f"made pgserver's binaries in {install} readable by every user" in said
        assert said[-1] == f"gave {pgdata} to {user}"
        assert pgdata.stat().st_uid == pwd.getpwnam(user).pw_uid
        # Done once: a second hand-over changes nothing and says nothing.
        assert embedded_root.hand_over(user, pgdata, install) == []
    finally:
        subprocess.run(["userdel", user], check=False, capture_output=True)
