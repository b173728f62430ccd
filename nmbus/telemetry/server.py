"""The HTTP server of a bus's metrics port: ``/metrics``, ``/healthz`` and ``/readyz``.

A small WSGI server of the standard library (as prometheus_client's own
``start_wsgi_server``), in a daemon thread, one thread per request: a probe
that waits for the database never holds up a scrape. It only reads: nothing
can be changed through it. Quiet: no log line per request, and a client that
hangs up mid-answer (a probe's timeout) prints nothing either.

``/metrics`` (and, as before, any other path) is the Prometheus exposition
of the bus's registry; ``/healthz`` and ``/readyz`` answer 200 or 503 with one
line of text (:mod:`nmbus.telemetry.health`).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from nmbus.errors import ConfigurationError

#: A WSGI application (the Prometheus exposition).
App = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
#: A probe: whether it holds (200, else 503), and its one line.
Probe = Callable[[], tuple[bool, str]]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return None


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        return None  # a client gone mid-answer: nothing to say


class PortServer:
    """Serves ``metrics`` and the ``probes`` by path on ``host:port`` from a daemon thread."""

    def __init__(self, host: str, port: int, metrics: App, probes: Mapping[str, Probe]) -> None:
        self.host = host
        self.requested_port = port
        self._metrics = metrics
        self._probes = dict(probes)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"<PortServer {self.host}:{self.port}>"

    def start(self) -> None:
        if self._server is not None:
            return
        try:
            infos = socket.getaddrinfo(
                self.host, self.requested_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
            family, _, _, _, address = infos[0]

            class Bound(_Server):
                address_family = family

            server = make_server(
                str(address[0]), self.requested_port, self._app, Bound, handler_class=_QuietHandler
            )
        except OSError as exc:
            raise ConfigurationError(
                f"cannot serve metrics on {self.host}:{self.requested_port}: {exc.strerror or exc}"
                " (NMBUS_METRICS_HOST / NMBUS_METRICS_PORT)"
            ) from exc
        thread = threading.Thread(
            target=server.serve_forever, name=f"nmbus-port-{server.server_port}", daemon=True
        )
        thread.start()
        self._server, self._thread = server, thread

    @property
    def port(self) -> int | None:
        """The port served (the one picked when 0 was asked), None while stopped."""
        return int(self._server.server_port) if self._server is not None else None

    def stop(self) -> None:
        """Stop serving and free the port (blocks until the serving thread has ended)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        probe = self._probes.get(environ.get("PATH_INFO", ""))
        if probe is None:
            return self._metrics(environ, start_response)
        if environ.get("REQUEST_METHOD") != "GET":
            start_response("405 Method Not Allowed", [("Allow", "GET")])
            return [b""]
        try:
            holds, line = probe()
        except Exception as exc:  # never a traceback on the worker's stderr
            holds, line = False, f"the probe failed: {type(exc).__name__}"
        body = f"{line}\n".encode()
        start_response(
            "200 OK" if holds else "503 Service Unavailable",
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("Content-Length", str(len(body))),
                ("Cache-Control", "no-store"),
            ],
        )
        return [body]
