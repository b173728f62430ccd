"""The dashboard as a process on a free port, for the tests that look at its pages."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from tests.procs import ROOT
from tests.waits import wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[str]

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, str, Any]:
        req = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, resp.read().decode(), resp.headers
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode(), err.headers

    def post(
        self, path: str, form: dict[str, str], headers: dict[str, str] | None = None
    ) -> tuple[int, str]:
        data = urlencode(form).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=headers or {})
        opener = urllib.request.build_opener(_NoRedirect)
        try:
            with opener.open(req, timeout=30) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def launch(dsn: str, *args: str, url_host: str = "127.0.0.1") -> Server:
    """The dashboard starting on a free port; ``url_host`` is how to reach it (as --host says)."""
    port = free_port()
    cmd = [sys.executable, "-m", "nmbus", "dashboard", "--dsn", dsn, "--port", str(port), *args]
    env = {k: v for k, v in os.environ.items() if k != "NMBUS_DASHBOARD_TOKEN"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    return Server(f"http://{url_host}:{port}", proc)


async def start(dsn: str, *args: str, url_host: str = "127.0.0.1") -> Server:
    """The dashboard on a free port, once it answers."""
    server = launch(dsn, *args, url_host=url_host)
    proc = server.proc

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"dashboard exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            return server.get("/healthz")[0] == 200
        except OSError:
            return False

    await wait_until(healthy, interval=0.1, what="the dashboard's /healthz")
    return server
