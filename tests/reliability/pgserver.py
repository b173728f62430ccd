"""A PostgreSQL server of the test's own, which the restart tests may stop and start.

The shared server other tests use must never be restarted, so the restart tests
initdb a throw-away cluster in a temporary directory with the PostgreSQL
binaries of the machine (``NMBUS_PG_BIN``, else the newest
``/usr/lib/postgresql/*/bin``), listening on 127.0.0.1 and a free port with
trust authentication. Running as root, every server command runs as the
``postgres`` system user, which owns the data directory.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def find_bin() -> Path:
    given = os.environ.get("NMBUS_PG_BIN")
    candidates = [given] if given else sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_ver)
    for folder in reversed(candidates):
        if folder and (Path(folder) / "pg_ctl").exists():
            return Path(folder)
    raise RuntimeError(
        "the PostgreSQL restart tests need PostgreSQL server binaries (initdb, pg_ctl): "
        "install the postgresql package or set NMBUS_PG_BIN to their folder"
    )


def _ver(path: str) -> float:
    try:
        return float(Path(path).parent.name)
    except ValueError:
        return 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateServer:
    """initdb, start, stop, restart and remove one PostgreSQL cluster."""

    def __init__(self) -> None:
        self.bin = find_bin()
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="nmbus-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self._as_root = os.geteuid() == 0
        if self._as_root:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin / args[0]), *args[1:]]
        if self._as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, check=False, cwd=self.root
        )
        if result.returncode != 0:
            tail = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise RuntimeError(
                f"{' '.join(args[:2])} failed ({result.returncode}):\n{result.stdout}\n"
                f"{result.stderr}\n{tail}"
            )
        return result

    def init(self) -> None:
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
            "--locale=C",
        )

    def _options(self) -> str:
        return (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root}"
            " -c max_connections=60 -c shared_buffers=32MB -c fsync=off"
            " -c full_page_writes=off -c log_min_messages=warning"
        )

    def start(self) -> None:
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-o",
            self._options(),
            "-w",
            "-t",
            "60",
            "start",
        )

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self, mode: str = "fast") -> None:
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-m",
            mode,
            "-o",
            self._options(),
            "-l",
            str(self.log),
            "-w",
            "-t",
            "60",
            "restart",
        )

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def remove(self) -> None:
        try:
            if self.running():
                self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def private_server() -> Iterator[PrivateServer]:
    """A server of its own, initialised and started; removed, data and all, afterwards."""
    server = PrivateServer()
    try:
        server.init()
        server.start()
        yield server
    finally:
        server.remove()
