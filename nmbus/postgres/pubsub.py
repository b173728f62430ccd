"""Publishing on PostgreSQL: one server-side call per fan-out.

``nmbus_publish_v3`` (nmbus/postgres/sql/pubsub.sql) looks up the live subscribers and
inserts the copies into every subscriber's queue table in the same statement,
so a publish is one round trip whatever the number of subscribers, and it sees
every subscription committed before it began (there is no cache to go stale).

A subscriber's queue table may not exist yet (a subscription written by hand,
or a dropped queue): the function then stores nothing and names the missing
tables; they are created on the same connection, inside the same transaction
(so a caller's rollback removes them too, and nothing is committed half-way),
and the call is repeated.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import structlog

from nmbus.errors import StoreError
from nmbus.messages import Envelope
from nmbus.names import validate_queue_name
from nmbus.postgres.errors import wrap_errors
from nmbus.postgres.listen import notify_channel
from nmbus.postgres.rows import envelope_arrays
from nmbus.postgres.sql import render

log = structlog.get_logger("nmbus.postgres")

# A subscriber can appear (with its table missing) between two calls; give up
# after this many rounds rather than loop.
MAX_ROUNDS = 5


async def install_publish_function(conn: Any, schema: str) -> None:
    """Create nmbus_publish_v3 in ``schema`` unless it exists (serialised by the schema lock)."""
    if await conn.fetchval(render("publish_function_exists", schema), schema):
        return
    async with conn.transaction():
        await conn.execute(render("advisory_lock", schema), f"nmbus.schema.{schema}")
        if not await conn.fetchval(render("publish_function_exists", schema), schema):
            await conn.execute(render("create_publish_function", schema))
            log.info("publish_function_installed", schema=schema)


def publish_args(
    schema: str,
    publisher: str,
    envelopes: Sequence[Envelope],
    chains: Sequence[str],
    channel: str,
    routed: Collection[str] = (),
) -> tuple[Any, ...]:
    """The parameters $1..$15 of ``publish`` (the call of nmbus_publish_v3)."""
    arrays = envelope_arrays(envelopes)
    return (
        schema,
        publisher,
        list(chains),
        arrays["label"],
        arrays["msg_text"],
        arrays["msg_headers"],
        arrays["correlation_id"],
        arrays["unique_id"],
        arrays["deliver_at"],
        channel,
        arrays["priority"],
        arrays["sequence_key"],
        arrays["expires_at"],
        sorted(routed),
        notify_channel(schema, outbox=True),
    )


async def publish_on(conn: Any, schema: str, args: tuple[Any, ...]) -> dict[str, int]:
    """Run the fan-out on ``conn``; create missing subscriber tables in its transaction.

    ``conn`` must be inside a transaction when a table can be missing: callers
    that own the connection wrap this in one.
    """
    sql = render("publish", schema)
    for _ in range(MAX_ROUNDS):
        with wrap_errors("publish"):
            rows = await conn.fetch(sql, *args)
        missing = [r[0] for r in rows if r[2]]
        if not missing:
            return {r[0]: int(r[1]) for r in rows}
        for queue in missing:
            await create_queue_on(conn, schema, queue)
    raise StoreError(f"publish: subscriber queue tables kept disappearing after {MAX_ROUNDS} tries")


async def create_queue_on(conn: Any, schema: str, queue: str) -> None:
    """Create a queue table in the transaction of ``conn`` (it commits or rolls back with it).

    The one way nmbus creates a queue table: under the schema's advisory lock,
    idempotent, and registered in ``{schema}.queues``.
    """
    validate_queue_name(queue)
    with wrap_errors(f"create queue {queue}"):
        await conn.execute(render("advisory_lock", schema), f"nmbus.schema.{schema}")
        await conn.execute(render("create_queue", schema, queue))
        await conn.execute(render("register_queue", schema), queue)
    log.info("queue_created", queue=queue, schema=schema)
