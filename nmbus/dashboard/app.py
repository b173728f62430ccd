"""The dashboard's Starlette application: pages, fragments, actions and /metrics.

Reads are GETs that render templates from what :class:`nmbus.ops.admin.Admin`
returns. Changes (requeue, purge) are POSTs, and each one passes three checks
before it touches a row: the dashboard is not read-only, the form carries the
CSRF value of its cookie (a double-submit cookie, SameSite=Strict, and an
Origin header, when sent, naming this very host), and the form carries the
token. A change acts only on what its confirmation page counted: the form
carries, per queue, the highest id and the time of that count. Every page
answers with a Content-Security-Policy that allows only the dashboard's own
script (inline, allowed by its hash: :mod:`nmbus.dashboard.script`) and
style, so text from the database (queue names, labels, bodies, errors) is
escaped by the templates and could not run anyway; texts longer than a page
should carry are cut, with a link to the whole text as plain text.
"""

from __future__ import annotations

import asyncio
import math
import secrets
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from importlib.resources import files
from typing import Any
from urllib.parse import urlencode

from markupsafe import Markup
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from nmbus.contracts.encryption import readable
from nmbus.dashboard import charts, display, forms, guard
from nmbus.dashboard.guard import DashboardOptions
from nmbus.dashboard.hosts import is_loopback
from nmbus.dashboard.metrics import exposition
from nmbus.dashboard.script import REFRESH_SCRIPT
from nmbus.envelopes import stored_apart
from nmbus.errors import (
    InvalidQueueName,
    NmbusError,
)
from nmbus.ops.admin import (
    WINDOW_ROWS,
    Admin,
    FailedCount,
    FailedPage,
    QueueDepth,
    QueueStatus,
    SegmentInfo,
)

__all__ = ["DashboardOptions", "create_app", "is_loopback", "overview"]

PAGE_SIZE = 50
# Queues per page of the queues page.
QUEUES_PER_PAGE = 50
# A queue's page lists this many of its segments, newest first, and says how
# many older ones it leaves out (`nmbus segments QUEUE` lists every one).
SEGMENTS_SHOWN = 50
# A message's error, body and headers are shown up to this many characters
# each; the rest is a link away (the whole text, served as plain text).
TEXT_SHOWN = 64 * 1024
# An error line in a list of failed messages is cut at this many characters.
ERROR_LINE_SHOWN = 500
TEXT_PARTS = ("error", "body", "headers")

_HERE = files("nmbus.dashboard")


def create_app(admin: Admin, options: DashboardOptions) -> Starlette:
    """The dashboard over ``admin`` (closed when the application shuts down)."""
    templates = Jinja2Templates(directory=str(_HERE.joinpath("templates")))
    templates.env.globals.update(
        read_only=options.read_only,
        refresh_script=REFRESH_SCRIPT,
        refresh_ms=int(options.refresh_seconds * 1000),
        database=options.database,
        schema=admin.schema,
        seconds=display.seconds,
        number=display.number,
        ms=display.ms,
        utc=display.utc,
        size=display.size,
        disk=display.disk,
        text_shown=f"{TEXT_SHOWN:,}",
        text_limit=TEXT_SHOWN,
        per_page=QUEUES_PER_PAGE,
        window_rows=f"{WINDOW_ROWS:,}".replace(",", " "),
    )

    async def page(
        request: Request, name: str, context: dict[str, Any], status: int = 200
    ) -> Response:
        csrf = request.cookies.get(guard.CSRF_COOKIE) or secrets.token_urlsafe(24)
        extra: dict[str, Any] = {"csrf": csrf}
        if not name.startswith("_"):  # a whole page: its header shows the schema's version
            extra["schema_version"] = await _schema_version(admin)
        response = templates.TemplateResponse(
            request, name, {**context, **extra}, status_code=status
        )
        if request.cookies.get(guard.CSRF_COOKIE) != csrf:
            response.set_cookie(
                guard.CSRF_COOKIE, csrf, httponly=True, samesite="strict", path="/", max_age=86400
            )
        return guard.security_headers(response)

    async def queues_context(request: Request) -> dict[str, Any]:
        params = request.query_params
        wanted = (params.get("q") or "").strip()
        if len(wanted) > forms.MAX_FILTER:
            raise HTTPException(
                400, f"the queue filter is longer than {forms.MAX_FILTER} characters"
            )
        number = forms.page_number(params.get("page"))
        depths = await admin.queue_depths()
        matching = [d for d in depths if wanted.casefold() in d.queue.casefold()]
        matching.sort(key=_attention)
        pages = max(1, math.ceil(len(matching) / QUEUES_PER_PAGE))
        number = min(number, pages)
        first = (number - 1) * QUEUES_PER_PAGE
        shown = matching[first : first + QUEUES_PER_PAGE]

        def link(to: int) -> str:
            query = {"q": wanted} if wanted else {}
            if to > 1:
                query["page"] = str(to)
            return "?" + urlencode(query) if query else ""

        return {
            "rows": await overview(admin, [d.queue for d in shown]),
            "filter": wanted,
            "total": len(depths),
            "matching": len(matching),
            "first": first + 1,
            "last": first + len(shown),
            "page_number": number,
            "pages": pages,
            "here": link(number),
            "previous": link(number - 1) if number > 1 else None,
            "next": link(number + 1) if number < pages else None,
        }

    async def queues_page(request: Request) -> Response:
        context = await queues_context(request)
        return await page(request, "queues.html", {**context, "title": "Queues"})

    async def queues_fragment(request: Request) -> Response:
        return await page(request, "_queues_table.html", await queues_context(request))

    async def queue_context(name: str) -> dict[str, Any]:
        status = await admin.queue_detail(name, (300.0, 3600.0))
        history = await admin.queue_history(name, bucket_seconds=60.0, buckets=60)
        segments = await admin.queue_segments([name])
        return {
            "q": status,
            "chart": charts.history_chart(history),
            "title": name,
            "segments": segments_summary(segments),
            "limits": await admin.flow_status([name]),
        }

    async def queue_page(request: Request) -> Response:
        return await page(request, "queue.html", await queue_context(request.path_params["name"]))

    async def queue_fragment(request: Request) -> Response:
        name = request.path_params["name"]
        return await page(request, "_queue_body.html", await queue_context(name))

    async def failed_page(request: Request) -> Response:
        filters = forms.filters(request.query_params)
        found: FailedPage = await admin.failed_page(
            filters["queue"],
            message_type=filters["type"],
            error_contains=filters["error"],
            cursor=request.query_params.get("cursor") or None,
            limit=PAGE_SIZE,
            error_chars=ERROR_LINE_SHOWN,
        )
        next_url = None
        if found.next_cursor:
            query = {k: v for k, v in filters.items() if v} | {"cursor": found.next_cursor}
            next_url = "/failed?" + urlencode(query)
        return await page(
            request,
            "failed.html",
            {
                "page": found,
                "filters": filters,
                "queues": await admin.list_queues(),
                "next_url": next_url,
                "note": request.query_params.get("note", "")[:300],
                "title": "Failed messages",
                "matching": urlencode({k: v for k, v in filters.items() if v}),
            },
        )

    async def message_page(request: Request) -> Response:
        queue = request.path_params["queue"]
        ident = forms.message_id(request.path_params["id"])
        row = await admin.message(queue, ident, max_chars=TEXT_SHOWN)
        if row is None:
            raise HTTPException(404, f"no message {ident} in queue {queue}")
        body = (
            row.msg_text
            if row.msg_text_chars > TEXT_SHOWN
            else display.pretty(readable(row.msg_text))
        )
        if row.msg_text is None:
            body = stored_apart(row.msg_headers) or body  # the claim check
        headers = (
            row.msg_headers
            if row.msg_headers_chars > TEXT_SHOWN
            else display.pretty(row.msg_headers)
        )
        if headers in ("{}", "null"):  # a message sent without headers: nothing to show
            headers = ""
        return await page(
            request,
            "message.html",
            {
                "queue": queue,
                "m": row,
                "version": display.version(row.msg_headers, cut=row.msg_headers_chars > TEXT_SHOWN),
                "texts": [
                    ("error", "Error", row.error_info or "", row.error_info_chars),
                    ("body", "Body", body or "", row.msg_text_chars),
                    ("headers", "Headers", headers or "", row.msg_headers_chars),
                ],
                "title": f"{queue} #{ident}",
            },
        )

    async def message_text(request: Request) -> Response:
        queue = request.path_params["queue"]
        ident = forms.message_id(request.path_params["id"])
        part = request.path_params["part"]
        if part not in TEXT_PARTS:
            raise HTTPException(404, "no such part of a message: error, body or headers")
        text = await admin.message_text(queue, ident, part)
        # Plain text, never sniffed as markup (nosniff): whatever it holds is shown as text.
        return guard.security_headers(PlainTextResponse(text or ""))

    async def confirm_page(request: Request) -> Response:
        if options.read_only:
            raise HTTPException(403, "this dashboard is read-only")
        action = forms.action(request.query_params.get("action", ""))
        filters = forms.filters(request.query_params)
        ident = request.query_params.get("id")
        ids = [forms.message_id(ident)] if ident else None
        targets = [filters["queue"]] if filters["queue"] else await admin.list_queues()
        counts: list[FailedCount] = []
        for queue in targets:
            found = await admin.failed_count(
                queue, ids=ids, message_type=filters["type"], error_contains=filters["error"]
            )
            if found.count:
                counts.append(found)
        return await page(
            request,
            "confirm.html",
            {
                "action": action,
                "filters": filters,
                "id": ids[0] if ids else None,
                "counts": counts,
                "counted": forms.dump_counted(counts),
                "total": sum(c.count for c in counts),
                "title": f"Confirm {action}",
                "back": urlencode({k: v for k, v in filters.items() if v}),
            },
        )

    async def act(request: Request) -> Response:
        action = forms.action(request.path_params["action"])
        form = await request.form()
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        guard.check_change(request, fields, options)
        filters = forms.filters(fields)
        ident = fields.get("id")
        if ident and not filters["queue"]:
            raise HTTPException(400, "refused: a message id needs its queue")
        ids = [forms.message_id(ident)] if ident else None
        counted = forms.load_counted(fields.get("counted"))
        if filters["queue"] and any(c.queue != filters["queue"] for c in counted):
            raise HTTPException(400, "refused: the confirmation counted another queue")
        change = admin.requeue_failed if action == "requeue" else admin.purge_failed
        every = not (ids or filters["type"] or filters["error"])
        done = 0
        for count in counted:
            done += await change(
                count.queue,
                ids=ids,
                message_type=filters["type"],
                error_contains=filters["error"],
                every=every,
                counted=count,
            )
        verb = "requeued" if action == "requeue" else "purged"
        note = f"{verb} {done} message{'' if done == 1 else 's'}"
        left = 0
        if not ids:  # what matches now but was not counted: it failed after the confirmation
            targets = [filters["queue"]] if filters["queue"] else await admin.list_queues()
            for queue in targets:
                left += await admin.count_failed(
                    queue, message_type=filters["type"], error_contains=filters["error"]
                )
        if left:
            note += (
                f"; {left} more matching failed after the confirmation and were left "
                f"as they are (confirm again to {action} them)"
            )
        query = {k: v for k, v in filters.items() if v and not ident}
        query["note"] = note
        return RedirectResponse("/failed?" + urlencode(query), status_code=303)

    async def subscriptions_page(request: Request) -> Response:
        found = await admin.subscriptions()
        return await page(request, "subscriptions.html", {"subs": found, "title": "Subscriptions"})

    async def metrics(request: Request) -> Response:
        body = await exposition(admin)
        return guard.security_headers(
            Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
        )

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def on_error(request: Request, exc: Exception) -> Response:
        status, message = guard.status_of(exc)
        if request.url.path == "/metrics":
            return guard.security_headers(PlainTextResponse(message, status_code=status))
        return await page(request, "error.html", {"message": message, "title": "Error"}, status)

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
        Route("/failed/{queue}/{id}/{part}", message_text),
        Route("/confirm", confirm_page),
        Route("/actions/{action}", act, methods=["POST"]),
        Route("/subscriptions", subscriptions_page),
        Route("/metrics", metrics),
        Route("/healthz", health),
        Mount("/static", StaticFiles(directory=str(_HERE.joinpath("static"))), name="static"),
    ]
    middleware = (
        [Middleware(guard.HostGuard, allowed=options.allowed_hosts)]
        if options.allowed_hosts
        else []
    )
    return Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={HTTPException: on_error, NmbusError: on_error, Exception: on_error},
    )


async def overview(
    admin: Admin, queues: Sequence[str] | None = None
) -> list[tuple[QueueStatus, Markup]]:
    """What the queues page shows of ``queues`` (None: every queue): their status (5 and 60
    minute windows) and sparkline.

    The queues are read in as many parts at once as the admin's pool has
    connections: each figure is a few short statements, so a page waits on
    round trips, not on the database.
    """
    names = list(queues) if queues is not None else await admin.list_queues()
    parts = max(1, min(admin.pool_size, len(names)))
    groups = [names[k::parts] for k in range(parts)]

    async def history(name: str) -> Markup:
        try:
            found = await admin.queue_history(name, bucket_seconds=300.0, buckets=12, cap=1000)
        except InvalidQueueName:
            found = []  # a table registered by hand under a name nmbus refuses
        return charts.sparkline(found)

    read = await asyncio.gather(
        *(admin.queue_status(300.0, windows=[3600.0], queues=g) for g in groups if g)
    )
    status = {q.queue: q for found in read for q in found}
    sparks = await asyncio.gather(*(history(name) for name in names))
    return [(status[n], spark) for n, spark in zip(names, sparks, strict=True) if n in status]


def segments_summary(segments: Sequence[SegmentInfo]) -> dict[str, Any]:
    """What a queue's page shows of its segments (oldest first, as read): how many, its
    oldest row's insert_time, their size, and at most SEGMENTS_SHOWN of them, newest first,
    the one being written (the newest that holds rows) marked."""
    holding = [s for s in segments if s.oldest is not None]
    newest_first = list(reversed(segments))
    return {
        "count": len(segments),
        "oldest": holding[0].oldest if holding else None,
        "size_bytes": sum(s.size_bytes for s in segments),
        "shown": newest_first[:SEGMENTS_SHOWN],
        "more": max(len(segments) - SEGMENTS_SHOWN, 0),
        "writing": holding[-1].name if holding else None,
    }


def _attention(q: QueueDepth) -> tuple[bool, float, str]:
    """Queues with failed messages or blocked sequences first, then the longest wait, then name."""
    return (not (q.failed or q.blocked), -(q.oldest_ready_seconds or 0.0), q.queue)


async def _schema_version(admin: Admin) -> int | None:
    try:
        return await admin.schema_version()
    except NmbusError:
        return None  # the page still shows, its header without the version
