"""Cancellation on PostgreSQL: one statement per request (nmbus/delivery/cancellation.py)."""

from __future__ import annotations

from typing import Any

from nmbus.delivery.cancellation import Cancel
from nmbus.postgres.floor import read_floor
from nmbus.postgres.sql import render


async def cancel_on(conn: Any, schema: str, queue: str, request: Cancel) -> int:
    """Cancel what ``request`` names in ``queue``, on ``conn``; how many messages."""
    if request.unique_id is not None:
        sql = render("cancel_unique", schema, queue)
        return int(await conn.fetchval(sql, request.unique_id, request.reason))
    floor = await read_floor(conn, schema, queue)
    sql = render("cancel_correlated", schema, queue)
    return int(await conn.fetchval(sql, request.correlation_id, request.reason, floor))
