"""Logging an unexpected exception without leaking secrets.

``log.exception(...)`` hands the exception to the application's renderer, and
structlog's default one (rich) prints every frame's local variables: asyncpg's
frames hold the DSN and its password. :func:`log_failure` logs the event with
the error on one line and a plain traceback (``traceback.format_exception``,
no locals), both with passwords scrubbed.

A line per message is written only when the application configured structlog
(:func:`per_message_logs`): a library is quiet by default.
"""

from __future__ import annotations

import logging
import re
import traceback
from typing import Any

import structlog

_worker_log = structlog.get_logger("nmbus.worker")

# scheme://user:password@host (also scheme:/ and scheme:): the password runs to
# the last '@' of the line, so one holding '@', '/', ',', '%' or a space is
# hidden whole (a few characters of the host may go with it).
_URL_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]*:/{0,2}[^\s:/?#@'\"]*:)[^\n\r'\"]*@")
# password=... as a URL query parameter: up to the next '&'.
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#\n\r'\"]*", re.I)
# password=... as a libpq keyword or in a Python repr, quoted or not.
_KEYWORD_PASSWORD = re.compile(
    r"((?<![?&])\bpassword['\"]?\s*[=:]\s*)('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\s'\"]*)", re.I
)


def scrub(text: str) -> str:
    """``text`` with the password of every DSN in it replaced by ``***``.

    The one place passwords are hidden: exception texts, reprs and log lines
    that may hold a DSN all go through it.
    """
    if "password" not in text.lower() and "@" not in text:
        return text
    text = _URL_PASSWORD.sub(r"\1***@", text)
    text = _QUERY_PASSWORD.sub(r"\1***", text)
    return _KEYWORD_PASSWORD.sub(r"\1***", text)


def log_failure(
    logger: Any, event: str, exc: BaseException, level: str = "error", **fields: Any
) -> None:
    """Log ``event`` for ``exc`` at ``level``: ``error=`` one line, ``traceback=`` the rest.

    Use it instead of ``logger.exception(...)`` for exceptions nmbus did not
    expect, so no renderer can expand the frames' local variables.
    """
    try:
        text = str(exc)
    except Exception:
        text = "<str() failed>"
    name = type(exc).__name__
    headline = f"{name}: {text}".splitlines()[0] if text else name
    trace = "".join(traceback.format_exception(exc))
    getattr(logger, level)(event, error=scrub(headline), traceback=scrub(trace), **fields)


def per_message_logs() -> bool:
    """Whether to log a line per message: only when the application configured structlog.

    A library must be quiet by default; unconfigured, structlog would print
    every line, one per message handled.
    """
    return structlog.is_configured()


def debug_enabled() -> bool:
    """Whether the worker's per-message debug lines would be written (asked once per batch)."""
    if not per_message_logs():
        return False
    bound = _worker_log.bind()
    check = getattr(bound, "is_enabled_for", None)
    return bool(check(logging.DEBUG)) if check is not None else True
