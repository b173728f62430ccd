"""The dashboard's Starlette application: pages, fragments, actions and /metrics.

Reads are GETs that render templates from what :class:`nmbus.admin.Admin`
returns. Changes (requeue, purge) are POSTs, and each one passes three checks
before it touches a row: the dashboard is not read-only, the form carries the
CSRF value of its cookie (a double-submit cookie, SameSite=Strict, and an
Origin header, when sent, naming this very host), and the form carries the
token. Every page answers with a Content-Security-Policy that allows only the
dashboard's own script and style, so text from the database (queue names,
labels, bodies, errors) is escaped by the templates and could not run anyway.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import secrets
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.resources import files
from typing import Any
from urllib.parse import urlencode, urlsplit

from markupsafe import Markup
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from nmbus.admin import WINDOW_ROWS, Admin, FailedPage, QueueStatus
from nmbus.dashboard import charts
from nmbus.dashboard.metrics import exposition
from nmbus.errors import (
    ConfigurationError,
    DatabaseUnavailable,
    InvalidQueueName,
    NmbusError,
    QueueNotFound,
)
from nmbus.logs import scrub

CSRF_COOKIE = "nmbus_csrf"
PAGE_SIZE = 50
# Text filters longer than this are refused rather than sent to the database.
MAX_FILTER = 500

_HERE = files("nmbus.dashboard")


@dataclass(frozen=True)
class DashboardOptions:
    """How the dashboard behaves; the token is never empty (the CLI makes one if none is given)."""

    token: str
    read_only: bool = False
    refresh_seconds: float = 5.0
    database: str = ""  # what the header shows: the DSN without its password
    # Host headers served (any when None). On loopback the CLI names its own, so a
    # page on another site cannot read this one through a rebound DNS name.
    allowed_hosts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.token:
            raise ConfigurationError("the dashboard needs a token for its changes")
        if not 1.0 <= self.refresh_seconds <= 3600.0:
            raise ConfigurationError("refresh must be 1-3600 seconds")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is an address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _security_headers(response: Response) -> Response:
    response.headers["Content-Security-Policy"] = (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    )
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "same-origin"
    response.headers["Cache-Control"] = "no-store"
    return response


def create_app(admin: Admin, options: DashboardOptions) -> Starlette:
    """The dashboard over ``admin`` (closed when the application shuts down)."""
    templates = Jinja2Templates(directory=str(_HERE.joinpath("templates")))
    templates.env.globals.update(
        read_only=options.read_only,
        refresh_ms=int(options.refresh_seconds * 1000),
        database=options.database,
        seconds=_seconds,
        number=_number,
        ms=_ms,
        window_rows=f"{WINDOW_ROWS:,}".replace(",", " "),
    )

    def page(request: Request, name: str, context: dict[str, Any], status: int = 200) -> Response:
        csrf = request.cookies.get(CSRF_COOKIE) or secrets.token_urlsafe(24)
        response = templates.TemplateResponse(
            request, name, {**context, "csrf": csrf}, status_code=status
        )
        if request.cookies.get(CSRF_COOKIE) != csrf:
            response.set_cookie(
                CSRF_COOKIE, csrf, httponly=True, samesite="strict", path="/", max_age=86400
            )
        return _security_headers(response)

    async def queues_page(request: Request) -> Response:
        return page(request, "queues.html", {"rows": await overview(admin), "title": "Queues"})

    async def queues_fragment(request: Request) -> Response:
        return page(request, "_queues_table.html", {"rows": await overview(admin)})

    async def queue_context(name: str) -> dict[str, Any]:
        status = await admin.queue_detail(name, (300.0, 3600.0))
        history = await admin.queue_history(name, bucket_seconds=60.0, buckets=60)
        return {"q": status, "chart": charts.history_chart(history), "title": name}

    async def queue_page(request: Request) -> Response:
        return page(request, "queue.html", await queue_context(request.path_params["name"]))

    async def queue_fragment(request: Request) -> Response:
        name = request.path_params["name"]
        return page(request, "_queue_body.html", await queue_context(name))

    async def failed_page(request: Request) -> Response:
        filters = _filters(request.query_params)
        found: FailedPage = await admin.failed_page(
            filters["queue"],
            message_type=filters["type"],
            error_contains=filters["error"],
            cursor=request.query_params.get("cursor") or None,
            limit=PAGE_SIZE,
        )
        next_url = None
        if found.next_cursor:
            query = {k: v for k, v in filters.items() if v} | {"cursor": found.next_cursor}
            next_url = "/failed?" + urlencode(query)
        return page(
            request,
            "failed.html",
            {
                "page": found,
                "filters": filters,
                "queues": await admin.list_queues(),
                "next_url": next_url,
                "note": request.query_params.get("note", "")[:200],
                "title": "Failed messages",
                "matching": urlencode({k: v for k, v in filters.items() if v}),
            },
        )

    async def message_page(request: Request) -> Response:
        queue = request.path_params["queue"]
        ident = _message_id(request.path_params["id"])
        row = await admin.message(queue, ident)
        if row is None:
            raise HTTPException(404, f"no message {ident} in queue {queue}")
        return page(
            request,
            "message.html",
            {
                "queue": queue,
                "m": row,
                "body": _pretty(row.msg_text),
                "headers": _pretty(row.msg_headers),
                "title": f"{queue} #{ident}",
            },
        )

    async def confirm_page(request: Request) -> Response:
        if options.read_only:
            raise HTTPException(403, "this dashboard is read-only")
        action = _action(request.query_params.get("action", ""))
        filters = _filters(request.query_params)
        ident = request.query_params.get("id")
        ids = [_message_id(ident)] if ident else None
        targets = [filters["queue"]] if filters["queue"] else await admin.list_queues()
        counts = []
        for queue in targets:
            n = await admin.count_failed(
                queue, ids=ids, message_type=filters["type"], error_contains=filters["error"]
            )
            if n:
                counts.append((queue, n))
        return page(
            request,
            "confirm.html",
            {
                "action": action,
                "filters": filters,
                "id": ids[0] if ids else None,
                "counts": counts,
                "total": sum(n for _, n in counts),
                "title": f"Confirm {action}",
                "back": urlencode({k: v for k, v in filters.items() if v}),
            },
        )

    async def act(request: Request) -> Response:
        action = _action(request.path_params["action"])
        form = await request.form()
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        _check_change(request, fields, options)
        filters = _filters(fields)
        ident = fields.get("id")
        if ident and not filters["queue"]:
            raise HTTPException(400, "refused: a message id needs its queue")
        ids = [_message_id(ident)] if ident else None
        targets = [filters["queue"]] if filters["queue"] else await admin.list_queues()
        change = admin.requeue_failed if action == "requeue" else admin.purge_failed
        every = not (ids or filters["type"] or filters["error"])
        done = 0
        for queue in targets:
            done += await change(
                queue,
                ids=ids,
                message_type=filters["type"],
                error_contains=filters["error"],
                every=every,
            )
        verb = "requeued" if action == "requeue" else "purged"
        query = {k: v for k, v in filters.items() if v and not ident}
        query["note"] = f"{verb} {done} message{'' if done == 1 else 's'}"
        return RedirectResponse("/failed?" + urlencode(query), status_code=303)

    async def subscriptions_page(request: Request) -> Response:
        found = await admin.subscriptions()
        return page(request, "subscriptions.html", {"subs": found, "title": "Subscriptions"})

    async def metrics(request: Request) -> Response:
        body = await exposition(admin)
        return _security_headers(
            Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
        )

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def on_error(request: Request, exc: Exception) -> Response:
        status, message = _status_of(exc)
        if request.url.path == "/metrics":
            return _security_headers(PlainTextResponse(message, status_code=status))
        return page(request, "error.html", {"message": message, "title": "Error"}, status)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await admin.close()

    routes = [
        Route("/", queues_page),
        Route("/fragment/queues", queues_fragment),
        Route("/queues/{name}", queue_page),
        Route("/fragment/queues/{name}", queue_fragment),
        Route("/failed", failed_page),
        Route("/failed/{queue}/{id}", message_page),
        Route("/confirm", confirm_page),
        Route("/actions/{action}", act, methods=["POST"]),
        Route("/subscriptions", subscriptions_page),
        Route("/metrics", metrics),
        Route("/healthz", health),
        Mount("/static", StaticFiles(directory=str(_HERE.joinpath("static"))), name="static"),
    ]
    middleware = (
        [Middleware(TrustedHostMiddleware, allowed_hosts=list(options.allowed_hosts))]
        if options.allowed_hosts
        else []
    )
    return Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={HTTPException: on_error, NmbusError: on_error, Exception: on_error},
    )


async def overview(admin: Admin) -> list[tuple[QueueStatus, Markup]]:
    """What the queues page shows: every queue's status (5 and 60 minute windows) and sparkline."""
    queues = await admin.queue_status(300.0, windows=[3600.0])
    found = []
    for q in queues:
        try:
            history = await admin.queue_history(q.queue, bucket_seconds=300.0, buckets=12, cap=1000)
        except InvalidQueueName:
            history = []  # a table registered by hand under a name nmbus refuses
        found.append((q, charts.sparkline(history)))
    return found


def _check_change(request: Request, form: Mapping[str, str], options: DashboardOptions) -> None:
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


def _filters(params: Mapping[str, str]) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for key in ("queue", "type", "error"):
        value = (params.get(key) or "").strip()
        if len(value) > MAX_FILTER:
            raise HTTPException(400, f"the {key} filter is longer than {MAX_FILTER} characters")
        found[key] = value or None
    return found


def _action(text: str) -> str:
    if text not in ("requeue", "purge"):
        raise HTTPException(404, "no such action")
    return text


def _message_id(text: str) -> int:
    if not text.isdigit() or len(text) > 18:
        raise HTTPException(400, f"not a message id: {text[:40]!r}")
    return int(text)


def _pretty(text: str | None) -> str:
    if text is None:
        return ""
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        return text


def _status_of(exc: Exception) -> tuple[int, str]:
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


def _seconds(value: float | None) -> str:
    if value is None:
        return "–"
    if value < 120:
        return f"{value:.1f} s"
    if value < 7200:
        return f"{value / 60:.1f} min"
    if value < 172800:
        return f"{value / 3600:.1f} h"
    return f"{value / 86400:.1f} d"


def _number(value: float | None, estimated: bool = False) -> str:
    if value is None:
        return "–"
    text = f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"
    return f"≈{text}" if estimated else text


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:,.1f}"
