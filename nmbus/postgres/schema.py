"""The nmbus schema on PostgreSQL: install and migrate it, create queue tables, name channels.

One schema holds every queue table of a database (``{schema}.{queue}``),
the registry of queues, the subscriptions, the outbox and the periodic
records; its version is SCHEMA_VERSION (nmbus.ports.store), and an older one is
migrated in place under the schema's advisory lock.
"""

from __future__ import annotations

from typing import Any

import structlog

from nmbus.errors import QueueNotFound, SchemaVersionError
from nmbus.names import validate_queue_name, validate_schema_name
from nmbus.ports.store import SCHEMA_VERSION, Readiness
from nmbus.postgres.errors import wrap_errors
from nmbus.postgres.pubsub import create_queue_on
from nmbus.postgres.sql import QUERIES, names_a_queue, render

log = structlog.get_logger("nmbus.postgres")


# Schema changes after version 1, by the version they bring the schema to: names
# of the blocks in sql/migrations/, run once per schema, or once per queue table when the
# block names a queue's table or one of its objects (names_a_queue).
MIGRATIONS: dict[int, list[str]] = {
    2: ["migrate_2_fillfactor"],
    3: ["migrate_3_names", "migrate_3_queue"],
    4: ["migrate_4_isolated"],
    5: ["migrate_5_delivery"],
    6: ["migrate_6_routes"],
    7: ["migrate_7_done"],
    8: ["migrate_8_saga_instance"],
    9: ["migrate_9_periodic_due"],
    10: ["migrate_10_function", "migrate_10_segments", "migrate_10_publish"],
    11: ["migrate_11_flow", "migrate_11_group_index"],
    12: ["migrate_12_held"],
    13: ["migrate_13_drop_held"],
    14: ["migrate_14_unique_windows", "migrate_unique_function"],
    15: ["migrate_unique_function"],
    16: ["migrate_16_claim_check"],
}


async def install_schema(conn: Any, schema: str) -> None:
    """Create or migrate ``schema`` to SCHEMA_VERSION, holding an advisory lock."""
    validate_schema_name(schema)
    async with conn.transaction():
        await conn.execute(render("advisory_lock", schema), f"nmbus.schema.{schema}")
        exists = await conn.fetchval(render("schema_exists", schema), schema)
        version = await conn.fetchval(render("schema_version", schema)) if exists else None
        if version is not None and version > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"schema {schema!r} is at version {version}, newer than this nmbus "
                f"understands ({SCHEMA_VERSION}); upgrade nmbus"
            )
        if version is None:
            await conn.execute(render("create_schema", schema))
            await conn.execute(render("set_schema_version", schema), SCHEMA_VERSION)
            return
        for target in range(version + 1, SCHEMA_VERSION + 1):
            queues = [r[0] for r in await conn.fetch(render("list_queues", schema), schema)]
            for name in MIGRATIONS.get(target, []):
                if names_a_queue(QUERIES[name]):
                    for queue in queues:
                        await conn.execute(render(name, schema, queue))
                else:
                    await conn.execute(render(name, schema))
            await conn.execute(render("set_schema_version", schema), target)
            log.info("schema_migrated", schema=schema, version=target)


#: The comment of a queue table that a send created (docs/operations.md).
CREATED_BY_SEND = "nmbus: created by a send; no endpoint has started on it"


async def ensure_queue_on(
    conn: Any,
    schema: str,
    queue: str,
    known: set[str],
    sender: str | None = None,
    create: bool = True,
) -> None:
    """Make sure ``queue`` has a table, creating it in the transaction of ``conn``.

    ``known`` holds queues whose table is committed; one created here is not
    added, since the transaction that created it may still roll back. For a
    send (``sender`` is the sending endpoint) a table no endpoint created is
    refused with QueueNotFound unless ``create``; created, it is marked and
    logged (``queue_created_by_send``) once.
    """
    if queue in known:
        return
    validate_queue_name(queue)
    with wrap_errors(f"create queue {queue}"):
        exists = await conn.fetchval(render("queue_exists", schema), schema, queue)
    if exists:
        known.add(queue)
        return
    if sender is not None and not create:
        raise QueueNotFound(no_such_queue(queue))
    await create_queue_on(conn, schema, queue)
    if sender is not None:
        with wrap_errors(f"create queue {queue}"):
            await conn.execute(render("mark_created_by_send", schema, queue))
        log.warning("queue_created_by_send", queue=queue, sender=sender, schema=schema)


def no_such_queue(queue: str) -> str:
    return (
        f"no queue {queue!r}: no endpoint has started on it in this database (a typo?). "
        f"Start its endpoint first, create it with 'nmbus queues create {queue}', or let "
        "sends create queues (create_queues=True, NMBUS_CREATE_QUEUES=true)"
    )


async def readiness_on(conn: Any, schema: str, queue: str) -> Readiness:
    """What ``/readyz`` and ``nmbus health`` check: the schema's version, the queue's table."""
    if not await conn.fetchval(render("schema_exists", schema), schema):
        return Readiness(None, False)
    row = await conn.fetchrow(render("readiness", schema), schema, queue)
    # A schema whose version table is empty has no version yet: 0, older than any.
    return Readiness(int(row["version"] or 0), bool(row["queue_exists"]))


async def database_identity(conn: Any) -> tuple[Any, ...]:
    """What tells the database of ``conn`` apart from any other, on any server."""
    row = await conn.fetchrow(render("database_identity", "nmbus"))
    return tuple(row)
