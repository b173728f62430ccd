"""``nmbus dashboard``: a web page over the operations layer, for operators.

A Starlette application (install ``nmbus[dashboard]``) that renders server-side
templates and refreshes its tables with a few lines of JavaScript. It holds no
SQL: every figure and every action is a method of :class:`nmbus.ops.admin.Admin`,
the same ones the ``nmbus`` commands call. See docs/dashboard.md.

Importing this package needs none of the extra: the application is loaded
when ``create_app`` or ``DashboardOptions`` is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nmbus.dashboard.hosts import is_loopback

if TYPE_CHECKING:
    from nmbus.dashboard.app import DashboardOptions, create_app

__all__ = ["DashboardOptions", "create_app", "is_loopback"]


def __getattr__(name: str) -> Any:
    if name in ("DashboardOptions", "create_app"):
        from nmbus.dashboard import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
