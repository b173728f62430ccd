"""An embedded PostgreSQL for the demo: pip-installed, in a local folder, on TCP.

``pgserver`` (the ``embedded`` extra) ships PostgreSQL 16 binaries inside a
Python package. Its own server class listens only on a unix socket, but
Spark's JDBC driver needs TCP, so this module uses pgserver for what it does
well (the binaries, and the system user it needs when running as root) and
drives ``pg_ctl`` itself: the data folder is started with
``-h 127.0.0.1 -p PORT`` and no unix socket at all.

Start and stop are idempotent and safe to call from several processes (a lock
file serialises them):

- a server already running on this folder over TCP is reused as it is;
- one running socket-only (started by pgserver's own ``get_server``) is
  stopped and started again on TCP;
- a stale ``postmaster.pid`` (the server was killed, the machine rebooted, or
  its pid now belongs to another process) is removed before starting.

Running as root changes the machine. PostgreSQL refuses to run as root, so
(as pgserver does) the server then runs as the system user ``pgserver``: the
first :meth:`EmbeddedPostgres.start` creates that user with ``useradd``, opens
the folders above the data folder and the pgserver binaries to other users,
and gives it the data folder. All of it is in :mod:`nmbus.demo.embedded_root`,
runs only when the effective uid is 0 and only in ``start()``, never at
import, and is logged. As any other user, nothing outside the data folder is
touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from nmbus.demo import embedded_root
from nmbus.errors import ConfigurationError, NmbusError

log = structlog.get_logger("nmbus.demo.embedded")

DEFAULT_DATA_DIR = Path(".nmbus")
HOST = "127.0.0.1"
INSTALL_HINT = "pip install 'nmbus[embedded]'  (the pgserver package)"


class EmbeddedUnavailable(ConfigurationError):
    """pgserver is not installed, so no embedded PostgreSQL can be started."""


class EmbeddedError(NmbusError):
    """The embedded PostgreSQL did not start or stop; the message holds its log."""


@dataclass(frozen=True)
class Running:
    """A server found running on the data folder."""

    pid: int
    port: int | None
    host: str | None

    @property
    def on_tcp(self) -> bool:
        return self.port is not None and self.host is not None and HOST in self.host.split(",")


def _bin_dir() -> Path:
    # Only the package's location is needed: importing pgserver would register its
    # own atexit clean-up and warn about XDG_RUNTIME_DIR.
    spec = importlib.util.find_spec("pgserver")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise EmbeddedUnavailable(
            f"no NMBUS_DSN is set and the embedded PostgreSQL is not installed: {INSTALL_HINT}, "
            "or set NMBUS_DSN=postgresql://... to use a server of your own"
        )
    return Path(locations[0]).resolve() / "pginstall" / "bin"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        # Someone else's process: ours would run as us (or as the system user under root).
        return os.geteuid() == 0
    return True


def _is_postgres(pid: int) -> bool:
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not cmdline.parent.exists():  # no procfs (macOS): trust the pid
        return _pid_alive(pid)
    try:
        return b"postgres" in cmdline.read_bytes()
    except OSError:
        return False


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _port_is_free(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As PostgreSQL binds: connections of the previous run in TIME_WAIT do not count.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _accepts_tcp(port: int, host: str = HOST, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class EmbeddedPostgres:
    """A PostgreSQL 16 in ``data_dir/pgdata``, listening on 127.0.0.1 only.

    ``start()`` returns the DSN; ``stop()`` stops it; both may be called any
    number of times, from any process.
    """

    def __init__(self, data_dir: Path | str = DEFAULT_DATA_DIR) -> None:
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.pgdata = self.data_dir / "pgdata"
        self.log_file = self.pgdata / "log"
        self._port_file = self.data_dir / "port"
        self._lock_file = self.data_dir / "lock"
        # The system user the server runs as: only when nmbus runs as root.
        self._user = embedded_root.system_user()
        # What the last start() changed on the machine (as root only), in words.
        self.machine_changes: list[str] = []

    # -- public ------------------------------------------------------------------

    @property
    def system_user(self) -> str | None:
        """The user the server runs as when nmbus runs as root (``pgserver``), else None."""
        return self._user

    @staticmethod
    def check_installed() -> None:
        """Raise EmbeddedUnavailable, saying what to install, when pgserver is missing."""
        _bin_dir()

    def dsn(self, port: int, database: str = "postgres") -> str:
        return f"postgresql://postgres@{HOST}:{port}/{database}"

    def running(self) -> Running | None:
        """The server running on this folder, or None (a stale pid file counts as none)."""
        pid_file = self.pgdata / "postmaster.pid"
        try:
            lines = pid_file.read_text().splitlines()
        except (FileNotFoundError, PermissionError):
            return None
        try:
            pid = int(lines[0])
        except (IndexError, ValueError):
            return None
        if not (_pid_alive(pid) and _is_postgres(pid)):
            return None
        port = int(lines[3]) if len(lines) > 3 and lines[3].strip().isdigit() else None
        host = lines[5].strip() if len(lines) > 5 and lines[5].strip() else None
        return Running(pid=pid, port=port, host=host)

    def status(self) -> str | None:
        """The DSN of the running server, or None."""
        found = self.running()
        if found is None or not found.on_tcp or found.port is None:
            return None
        return self.dsn(found.port)

    def start(self, timeout: float = 60.0) -> str:
        """Start (or reuse) the server and return its DSN; initialise the folder first."""
        bin_dir = _bin_dir()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with self._locked():
            found = self.running()
            if found is not None and found.on_tcp and found.port and _accepts_tcp(found.port):
                log.info("embedded_postgres_reused", pid=found.pid, port=found.port)
                return self.dsn(found.port)
            if found is not None:
                # Socket-only (pgserver's own start) or not answering: start it again on TCP.
                log.info("embedded_postgres_restarting", pid=found.pid, port=found.port)
                self._stop_locked(bin_dir, timeout)
            self._prepare(bin_dir)
            self._remove_stale_pid_file()
            return self._start_locked(bin_dir, timeout)

    def stop(self, timeout: float = 60.0) -> bool:
        """Stop the server if it runs; True when one was stopped."""
        if not self.pgdata.exists():
            return False
        bin_dir = _bin_dir()
        with self._locked():
            stopped = self._stop_locked(bin_dir, timeout)
            self._remove_stale_pid_file()
            return stopped

    def destroy(self, timeout: float = 60.0) -> None:
        """Stop the server and delete the whole data folder."""
        if self.pgdata.exists():
            self.stop(timeout)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    # -- internals -----------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock_file.open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _run(self, bin_dir: Path, program: str, *args: str, timeout: float) -> str:
        # Output goes to a file, not a pipe: pg_ctl's server inherits the pipe
        # otherwise and the call never returns.
        with open(os.devnull, "rb") as stdin, _TempOutput() as out:
            kwargs: dict[str, Any] = {"user": self._user} if self._user else {}
            result = subprocess.run(
                [str(bin_dir / program), *args],
                stdin=stdin,
                stdout=out.handle,
                stderr=subprocess.STDOUT,
                cwd=self.pgdata if self.pgdata.exists() else None,
                timeout=timeout,
                check=False,
                **kwargs,
            )
            text = out.read()
        if result.returncode != 0:
            raise subprocess.CalledProcessError(result.returncode, result.args, text)
        return text

    def _prepare(self, bin_dir: Path) -> None:
        """Create the data folder (and, as root, make it the system user's) and initdb it."""
        self.pgdata.mkdir(parents=True, exist_ok=True)
        if self._user is not None:
            # Root only: the system changes are all in nmbus.demo.embedded_root.
            self.machine_changes = embedded_root.hand_over(self._user, self.pgdata, bin_dir.parent)
        self.pgdata.chmod(0o700)
        if (self.pgdata / "PG_VERSION").exists():
            return
        log.info("embedded_postgres_initdb", pgdata=str(self.pgdata))
        try:
            self._run(
                bin_dir,
                "initdb",
                "-D",
                str(self.pgdata),
                "--auth=trust",
                "--encoding=UTF8",
                "--no-locale",
                "--no-sync",
                "-U",
                "postgres",
                timeout=120,
            )
        except subprocess.CalledProcessError as exc:
            raise EmbeddedError(f"initdb failed in {self.pgdata}:\n{exc.output}") from exc

    def _remove_stale_pid_file(self) -> None:
        pid_file = self.pgdata / "postmaster.pid"
        if pid_file.exists() and self.running() is None:
            log.info("embedded_postgres_stale_pid_file", path=str(pid_file))
            pid_file.unlink()

    def _choose_port(self) -> int:
        with contextlib.suppress(OSError, ValueError):
            previous = int(self._port_file.read_text())
            if _port_is_free(previous):
                return previous
        return free_port()

    def _start_locked(self, bin_dir: Path, timeout: float) -> str:
        last_error = ""
        for attempt in range(3):
            port = self._choose_port()
            try:
                self._run(
                    bin_dir,
                    "pg_ctl",
                    "-D",
                    str(self.pgdata),
                    "-l",
                    str(self.log_file),
                    "-w",
                    "-t",
                    str(int(timeout)),
                    # TCP on loopback only; an empty socket directory list means no unix socket.
                    "-o",
                    f"-h {HOST} -p {port} -k ''",
                    "start",
                    timeout=timeout + 10,
                )
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                last_error = f"{exc}\n{getattr(exc, 'output', '') or ''}"
                # The port was taken in between, or the old server's children still hold
                # its shared memory after a kill: wait a moment and try again.
                self._remove_stale_pid_file()
                with contextlib.suppress(FileNotFoundError):
                    self._port_file.unlink()
                time.sleep(1.0 + attempt)
                continue
            self._port_file.write_text(str(port))
            log.info("embedded_postgres_started", port=port, pgdata=str(self.pgdata))
            return self.dsn(port)
        raise EmbeddedError(
            f"the embedded PostgreSQL in {self.pgdata} did not start: {last_error}\n"
            f"--- {self.log_file} (end) ---\n{self._log_tail()}"
        )

    def _stop_locked(self, bin_dir: Path, timeout: float) -> bool:
        found = self.running()
        if found is None:
            return False
        try:
            self._run(
                bin_dir,
                "pg_ctl",
                "-D",
                str(self.pgdata),
                "-m",
                "fast",
                "-w",
                "-t",
                str(int(timeout)),
                "stop",
                timeout=timeout + 10,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            log.warning("embedded_postgres_stop_failed", pid=found.pid, error=str(exc))
            self._kill(found.pid, timeout)
        log.info("embedded_postgres_stopped", pid=found.pid)
        return True

    @staticmethod
    def _kill(pid: int, timeout: float) -> None:
        for sig in (signal.SIGINT, signal.SIGKILL):  # SIGINT is PostgreSQL's fast shutdown
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            deadline = time.monotonic() + timeout / 2
            while time.monotonic() < deadline and _pid_alive(pid):
                time.sleep(0.1)
            if not _pid_alive(pid):
                return

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"


class _TempOutput:
    """A temporary file to collect a child's output without a pipe."""

    def __enter__(self) -> _TempOutput:
        import tempfile

        self.handle = tempfile.TemporaryFile("w+b")
        return self

    def read(self) -> str:
        self.handle.seek(0)
        return self.handle.read().decode(errors="replace")

    def __exit__(self, *exc: object) -> None:
        self.handle.close()
