"""The server a DSN reaches must take writes: a hot standby is refused at start.

nmbus writes to its database from the first statement a worker runs (a claim
is an UPDATE) and a send is an INSERT. A DSN that reaches a read-only server
(a standby, or a primary whose ``default_transaction_read_only`` is on) would
start, and then fail at every claim and send; so a Bus refuses it when it
opens, and the operations refuse a standby, with the way out: point the DSN at
the primary, or name every server with ``target_session_attrs=read-write`` so
that the driver picks the one that takes writes (docs/reliability.md,
"Production PostgreSQL").
"""

from __future__ import annotations

from typing import Any

from nmbus.errors import InvalidSetting
from nmbus.logs import scrub
from nmbus.postgres.sql import render


async def refuse_read_only(conn: Any, dsn: str | None, *, standby_only: bool = False) -> None:
    """Raise InvalidSetting when ``conn``'s server cannot take nmbus's writes.

    ``standby_only``: refuse a hot standby alone, not a session read-only by
    default (``default_transaction_read_only``, set for a role or a database):
    that is how an operator lets a tool read and nothing else.
    """
    read_only, standby = await conn.fetchrow(render("server_read_only", "nmbus"))
    if not read_only or (standby_only and not standby):
        return
    what = (
        "a hot standby (in recovery)"
        if standby
        else "a server whose default_transaction_read_only is on"
    )
    raise InvalidSetting(
        f"the DSN {scrub(dsn or '')} reaches a read-only server, {what}: nmbus writes "
        "to its database; point the DSN at the primary, or name every server with "
        "target_session_attrs=read-write"
    )
