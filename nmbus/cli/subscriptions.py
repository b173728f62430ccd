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
from nmbus.cli._table import Column

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
    if as_json:
        emit_json([plain(s) for s in subscribed])
        return
    table(
        "subscriptions",
        [
            Column("publisher", key=True),
            Column("message type", key=True),
            Column("subscriber", key=True),
            "created",
            "expires",
            "live",
        ],
        [
            [
                s.publisher_endpoint,
                s.message_type,
                s.subscriber_endpoint,
                s.created_date,
                s.expiration_date or "never",
                "yes" if s.live else "expired",
            ]
            for s in subscribed
        ],
        empty="no subscriptions" + (f" of publisher {publisher}" if publisher else ""),
        split=False,  # narrower than the table: one block per subscription
    )
