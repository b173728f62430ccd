"""How a failure is written down: ``error_info``, the text stored with an R or F row.

The first line is ``Type: message`` (the statistics job and an operator group
failures by it), then the traceback from the handler's frame on. Whatever the
exception holds, the text can be stored.
"""

from __future__ import annotations

import os
import traceback

from nmbus.errors import AttemptFailed, MessageError

MAX_ERROR_INFO = 8000
# The dispatcher's own frames (its call of the handler, the trampoline's
# ``coro.send``) are in this package: a stored traceback starts below them.
_DISPATCH = os.path.dirname(os.path.abspath(__file__)) + os.sep


def storable(text: str) -> str:
    """``text`` as PostgreSQL text can hold it: no NUL, no lone surrogate."""
    text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:
        text = f"<str() of this {type(exc).__name__} failed>"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def error_info(exc: BaseException) -> str:
    """``Type: message`` on the first line (the statistics job groups by it), then the trace.

    An exception that was never raised and has no cause (a reason the worker
    records, like ``NoHandler``) is its first line alone. Whatever the
    exception holds (NUL, lone surrogates, a ``__str__`` that raises), the
    result can be stored: the real error is never lost to it.
    """
    lines = describe(exc).splitlines()
    first = lines[0] if lines else type(exc).__name__
    if exc.__traceback__ is None and exc.__cause__ is None:
        text = storable(first)
    else:
        try:
            trace = _user_trace(exc)
        except Exception:
            trace = f"(the traceback of this {type(exc).__name__} could not be formatted)"
        text = storable(f"{first}\n{trace}")
    return text if len(text) <= MAX_ERROR_INFO else text[: MAX_ERROR_INFO - 3] + "..."


def _user_trace(exc: BaseException) -> str:
    """The traceback of ``exc`` from the handler's frame on: the dispatcher's frames
    are left out at the top of each exception of the chain, unless nothing else is left."""
    shown = traceback.TracebackException.from_exception(exc)
    todo, seen = [shown], set()
    while todo:
        part = todo.pop()
        if id(part) in seen:
            continue
        seen.add(id(part))
        frames = list(part.stack)
        ours = next((n for n, f in enumerate(frames) if not f.filename.startswith(_DISPATCH)), 0)
        if ours:
            part.stack = traceback.StackSummary.from_list(frames[ours:])
        todo += [p for p in (part.__cause__, part.__context__) if p is not None]
        todo += getattr(part, "exceptions", None) or []
    return "".join(shown.format())


def because(failure: AttemptFailed | MessageError, cause: BaseException) -> BaseException:
    """``failure`` with ``cause`` as its ``__cause__``, as ``raise failure from cause`` would."""
    failure.__cause__ = cause
    return failure
