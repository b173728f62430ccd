"""``nmbus dashboard``: a web page over the operations layer, for operators.

A Starlette application (install ``nmbus[dashboard]``) that renders server-side
templates and refreshes its tables with a few lines of JavaScript. It holds no
SQL: every figure and every action is a method of :class:`nmbus.admin.Admin`,
the same ones the ``nmbus`` commands call. See docs/dashboard.md.
"""

from __future__ import annotations

from nmbus.dashboard.app import DashboardOptions, create_app, is_loopback

__all__ = ["DashboardOptions", "create_app", "is_loopback"]
