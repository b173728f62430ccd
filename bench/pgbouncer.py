"""A PgBouncer of its own in front of a PostgreSQL server, on a free loopback port.

The pooler tests (tests/test_pooler.py) and ``python -m bench pooler`` start
the machine's ``pgbouncer`` (Debian's package) with a configuration written
into a temporary directory: every database of the server behind it, trust
authentication, ``pool_mode = transaction`` unless told otherwise. PgBouncer
refuses to run as root: run by root, it runs as the ``postgres`` system user,
which owns that directory. It is stopped (SIGTERM, then SIGKILL) by the
process id it was started with.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit, urlunsplit

#: Where Debian's package puts it; else whatever ``pgbouncer`` is on PATH.
BINARY = "/usr/sbin/pgbouncer"
HOW_TO = "install PgBouncer (Debian: apt-get install pgbouncer)"


def find_pgbouncer() -> str:
    if os.access(BINARY, os.X_OK):
        return BINARY
    found = shutil.which("pgbouncer")
    if found is None:
        raise RuntimeError(f"no pgbouncer on this machine: {HOW_TO}")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgBouncer:
    """``with PgBouncer(server_dsn) as bouncer:``, then ``bouncer.dsn(database)``."""

    def __init__(
        self,
        server_dsn: str,
        pool_mode: str = "transaction",
        pool_size: int = 20,
        round_robin: bool = False,
    ):
        parts = urlsplit(server_dsn)
        self.server_host = parts.hostname or "127.0.0.1"
        self.server_port = parts.port or 5432
        self.user = parts.username or "postgres"
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        # server_round_robin: lend the server connections in turn rather than the
        # last one used, so that one client's transactions land on different ones.
        self.round_robin = round_robin
        self.port = _free_port()
        self.root = Path(tempfile.mkdtemp(prefix="nmbus-pgbouncer-"))
        self.log = self.root / "pgbouncer.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._server_dsn = server_dsn

    def dsn(self, database: str) -> str:
        """A DSN of ``database`` through the pooler (same user, the pooler's port)."""
        parts = urlsplit(self._server_dsn)
        netloc = f"{self.user}@127.0.0.1:{self.port}"
        return urlunsplit((parts.scheme, netloc, "/" + database, parts.query, ""))

    def _config(self) -> str:
        return "\n".join(
            [
                "[databases]",
                f"* = host={self.server_host} port={self.server_port}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {self.port}",
                "unix_socket_dir =",
                "auth_type = trust",
                f"auth_file = {self.root / 'users.txt'}",
                f"admin_users = {self.user}",
                f"pool_mode = {self.pool_mode}",
                f"default_pool_size = {self.pool_size}",
                f"server_round_robin = {int(self.round_robin)}",
                "max_client_conn = 500",
                f"logfile = {self.log}",
                f"pidfile = {self.root / 'pgbouncer.pid'}",
                "",
            ]
        )

    def start(self) -> None:
        (self.root / "users.txt").write_text(f'"{self.user}" ""\n')
        config = self.root / "pgbouncer.ini"
        config.write_text(self._config())
        command = [find_pgbouncer(), str(config)]
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            for path in (self.root, *self.root.iterdir()):
                os.chown(path, user.pw_uid, user.pw_gid)
            command = ["runuser", "-u", "postgres", "--", *command]
        self._process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=self.root
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                err = self._process.stderr.read().decode() if self._process.stderr else ""
                raise RuntimeError(f"pgbouncer exited at start: {err}{self._log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"pgbouncer did not listen within 15 s{self._log_tail()}")

    def check(self) -> None:
        """Raise RuntimeError, with the end of its log, when the pooler is no longer running."""
        if self._process is None or self._process.poll() is not None:
            code = None if self._process is None else self._process.returncode
            raise RuntimeError(f"pgbouncer is not running (exit code {code}){self._log_tail()}")

    def _log_tail(self) -> str:
        return "\n" + self.log.read_text()[-2000:] if self.log.exists() else ""

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        if process is not None and process.stderr is not None:
            process.stderr.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def show(self, what: str) -> list[dict[str, str]]:
        """``SHOW <what>`` on the pooler's admin console (STATS, POOLS, SERVERS, ...).

        Through psql: the console speaks only the simple query protocol, and
        asyncpg's fetch is always the extended one.
        """
        result = subprocess.run(
            ["psql", "-X", "-A", "-F", "\t", "-c", f"SHOW {what}", self.dsn("pgbouncer")],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        lines = result.stdout.splitlines()
        header = lines[0].split("\t")
        return [dict(zip(header, line.split("\t"), strict=True)) for line in lines[1:-1]]

    def __enter__(self) -> PgBouncer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
