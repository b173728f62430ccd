"""The dashboard's guards: its options, the Host check, the security headers every
answer carries, the checks a change passes, and the status an error answers with."""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from nmbus.dashboard.hosts import host_name
from nmbus.dashboard.script import REFRESH_SCRIPT_SOURCE
from nmbus.errors import (
    ConfigurationError,
    DatabaseUnavailable,
    InvalidQueueName,
    NmbusError,
    QueueNotFound,
)
from nmbus.logs import scrub

CSRF_COOKIE = "nmbus_csrf"


@dataclass(frozen=True)
class DashboardOptions:
    """How the dashboard behaves; the token is never empty (the CLI makes one if none is given)."""

    token: str
    read_only: bool = False
    refresh_seconds: float = 5.0
    database: str = ""  # what the header shows: the DSN without its password
    # Host header names served (any when None), without port. On loopback the CLI
    # names this machine's own (hosts.loopback_names), so a page on another site
    # cannot read this one through a rebound DNS name.
    allowed_hosts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.token:
            raise ConfigurationError("the dashboard needs a token for its changes")
        if not 1.0 <= self.refresh_seconds <= 3600.0:
            raise ConfigurationError("refresh must be 1-3600 seconds")


class HostGuard:
    """Answer 400 to a request whose Host header names none of ``allowed`` (port aside).

    Starlette's TrustedHostMiddleware cuts the header at its first colon, which
    cannot tell ``[::1]:8787`` from anything else: this one reads IPv6 too.
    """

    def __init__(self, app: ASGIApp, allowed: Sequence[str]) -> None:
        self.app = app
        self.allowed = frozenset(host_name(h) for h in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            header = Headers(scope=scope).get("host", "")
            if host_name(header) not in self.allowed:
                response = PlainTextResponse("Invalid host header", status_code=400)
                await security_headers(response)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def security_headers(response: Response) -> Response:
    response.headers["Content-Security-Policy"] = (
        f"default-src 'none'; script-src {REFRESH_SCRIPT_SOURCE}; style-src 'self'; "
        "img-src 'self'; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    )
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "same-origin"
    response.headers["Cache-Control"] = "no-store"
    return response


def check_change(request: Request, form: Mapping[str, str], options: DashboardOptions) -> None:
    """Refuse a change unless writable, same-site (CSRF) and carrying the token."""
    if options.read_only:
        raise HTTPException(403, "refused: this dashboard is read-only")
    origin = request.headers.get("origin")
    if origin is not None and urlsplit(origin).netloc != request.headers.get("host", ""):
        raise HTTPException(403, "refused: the form came from another site")
    cookie = request.cookies.get(CSRF_COOKIE, "")
    sent = form.get("csrf", "")
    if not cookie or not hmac.compare_digest(cookie.encode(), sent.encode()):
        raise HTTPException(403, "refused: missing or wrong CSRF value (reload the page)")
    token = form.get("token", "")
    if not token or not hmac.compare_digest(token.encode(), options.token.encode()):
        raise HTTPException(403, "refused: missing or wrong token")
    if form.get("confirm") != "yes":
        raise HTTPException(400, "refused: not confirmed")


def status_of(exc: Exception) -> tuple[int, str]:
    if isinstance(exc, HTTPException):
        return exc.status_code, str(exc.detail)
    if isinstance(exc, QueueNotFound):
        return 404, scrub(str(exc))
    if isinstance(exc, ConfigurationError | InvalidQueueName):
        return 400, scrub(str(exc))
    if isinstance(exc, DatabaseUnavailable):
        return 503, scrub(str(exc))
    if isinstance(exc, NmbusError):
        return 500, scrub(str(exc))
    return 500, f"internal error: {type(exc).__name__}"
