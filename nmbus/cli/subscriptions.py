"""``nmbus subscriptions list``: who receives what from whom."""

from __future__ import annotations

from typing import Annotated

import typer

from nmbus.cli import app
from nmbus.cli._common import (
    DsnOption,
    JsonOption,
    SchemaOption,
    emit_json,
    operate,
    plain,
    settings,
    table,
)

subscriptions = typer.Typer(help="Subscriptions of endpoints to publishers.", no_args_is_help=True)
app.add_typer(subscriptions, name="subscriptions")


@subscriptions.command("list")
def list_subscriptions(
    publisher: Annotated[str | None, typer.Option(help="only this publisher")] = None,
    live: Annotated[bool, typer.Option("--live", help="hide expired subscriptions")] = False,
    dsn: DsnOption = None,
    schema: SchemaOption = None,
    as_json: JsonOption = False,
) -> None:
    """Every subscription, by publisher and message type, with its expiry."""
    cfg = settings(dsn, schema)
    subscribed = operate(cfg, lambda admin: admin.subscriptions(publisher, live_only=live))
    found = [plain(s) for s in subscribed]
    if as_json:
        emit_json(found)
        return
    table(
        "subscriptions",
        ["publisher", "message type", "subscriber", "created", "expires", "live"],
        [
            [
                r["publisher_endpoint"],
                r["message_type"],
                r["subscriber_endpoint"],
                r["created_date"],
                r["expiration_date"] or "never",
                "yes" if r["live"] else "expired",
            ]
            for r in found
        ],
    )
