"""A primary and a streaming standby of the test's own, for failover tests.

Both are clusters in temporary directories (:class:`~tests.reliability.pgserver.PrivateServer`)
on free loopback ports: the primary made by ``initdb``, the standby by
``pg_basebackup -R`` from it (``standby.signal`` and ``primary_conninfo``
written for it). ``synchronous=True`` gives the primary
``synchronous_standby_names = '*'`` once its standby streams (``ALTER SYSTEM``
on the primary alone): before, every commit would wait for a standby not yet
there; in the standby's copy of the configuration, once promoted it would wait
for a standby of its own that never comes. :func:`replicated` stops both and
removes their directories however the test ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager

import asyncpg

from tests.reliability.pgserver import PrivateServer


class Server(PrivateServer):
    """A cluster whose command line may carry settings of its own (``-c name=value``)."""

    def __init__(self, settings: dict[str, str] | None = None) -> None:
        super().__init__()
        self.settings = dict(settings or {})

    def _options(self) -> str:
        extra = "".join(f" -c {name}={value}" for name, value in self.settings.items())
        return super()._options() + extra

    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def promote(self) -> None:
        """Ask this standby to become a primary; returns at once (the caller sees when)."""
        self._run("pg_ctl", "-D", str(self.data), "-W", "promote")

    def follow(self, primary: Server) -> None:
        """Make this (stopped) cluster a standby of ``primary``: it starts read-only.

        If its own WAL went past the point where ``primary`` was promoted (an
        immediate stop leaves it so), it cannot replay ``primary``'s timeline and
        stays at its own last state; read-only either way.
        """
        (self.data / "standby.signal").touch()
        conninfo = f"host=127.0.0.1 port={primary.port} user=postgres"
        with (self.data / "postgresql.auto.conf").open("a") as conf:
            conf.write(f"primary_conninfo = '{conninfo}'\nrecovery_target_timeline = 'latest'\n")
        shutil.chown(self.data / "standby.signal", "postgres", "postgres")


class Pair:
    """A primary, its standby, and the DSN that names both (``target_session_attrs=read-write``)."""

    def __init__(self, synchronous: bool) -> None:
        # Replication needs wal_level replica and WAL senders: the defaults.
        self.primary = Server()
        self.standby = Server({"hot_standby": "on"})
        self.synchronous = synchronous
        self.database = "failover"

    def dsn(self, *servers: Server, read_write: bool = True) -> str:
        """A DSN naming ``servers`` (default: primary, then standby) in that order."""
        hosts = ",".join(s.address() for s in (servers or (self.primary, self.standby)))
        query = "?target_session_attrs=read-write" if read_write else ""
        return f"postgresql://postgres@{hosts}/{self.database}{query}"

    def start(self) -> None:
        self.primary.init()
        self.primary.start()
        _fetch(self.primary.dsn, f'CREATE DATABASE "{self.database}"')
        self.standby._run(
            "pg_basebackup",
            "-D",
            str(self.standby.data),
            "-h",
            "127.0.0.1",
            "-p",
            str(self.primary.port),
            "-U",
            "postgres",
            "-R",  # standby.signal and primary_conninfo
            "-X",
            "stream",
            "-c",
            "fast",
            "--no-sync",
        )
        self.standby.start()
        if self.synchronous:
            _fetch(self.primary.dsn, "ALTER SYSTEM SET synchronous_standby_names = '*'")
            _fetch(self.primary.dsn, "SELECT pg_reload_conf()")
        self.wait_streaming()

    def wait_streaming(self, timeout: float = 30.0) -> None:
        """Until the primary sees its standby streaming (in sync when synchronous)."""
        wanted = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + timeout
        while True:
            states = _fetch(self.primary.dsn, "SELECT state, sync_state FROM pg_stat_replication")
            if ("streaming", wanted) in states:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the standby is not streaming ({wanted}): {states}")
            time.sleep(0.1)

    def cut(self, timeout: float = 30.0) -> None:
        """The standby stops receiving WAL, as one that lags when its primary dies.

        Its primary_conninfo then names a port nobody listens on; this returns once
        the primary has no standby streaming: what commits after is not replicated
        (with synchronous replication, commits wait for a standby from now on).
        """
        _fetch(self.standby.dsn, "ALTER SYSTEM SET primary_conninfo = 'host=127.0.0.1 port=1'")
        _fetch(self.standby.dsn, "SELECT pg_reload_conf()")
        deadline = time.monotonic() + timeout
        while _fetch(self.primary.dsn, "SELECT count(*) FROM pg_stat_replication") != [(0,)]:
            if time.monotonic() > deadline:
                raise AssertionError("the standby still streams")
            time.sleep(0.05)

    def remove(self) -> None:
        try:
            self.standby.remove()
        finally:
            self.primary.remove()


@contextmanager
def replicated(synchronous: bool) -> Iterator[Pair]:
    """A started primary and streaming standby; both stopped and removed afterwards."""
    pair = Pair(synchronous)
    try:
        pair.start()
        yield pair
    finally:
        pair.remove()


def log_lines(server: Server, since: int = 0) -> list[str]:
    """The server's log, from byte ``since`` on."""
    with server.log.open("rb") as log:
        log.seek(since)
        return log.read().decode(errors="replace").splitlines()


def _fetch(dsn: str, sql: str) -> list[tuple[object, ...]]:
    """One statement on a connection of its own, from synchronous code (even inside a loop)."""

    async def run() -> list[tuple[object, ...]]:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            return [tuple(r) for r in await conn.fetch(sql)]
        finally:
            await conn.close()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run()).result()
