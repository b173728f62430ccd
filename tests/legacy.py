"""Queue tables as schema version 9 and earlier made them: one plain table each.

For the upgrade tests: a database that an older nmbus left, with queue tables
that are not segmented, holding their unique index on unique_id.
"""

from __future__ import annotations

import asyncpg

from nmbus.postgres.sql import own_name, quote_ident

# The queue table of schema version 9, as create_queue made it then.
_V9_QUEUE = """
CREATE TABLE {queue} (
    id bigint GENERATED ALWAYS AS IDENTITY (SEQUENCE NAME {id_seq})
        CONSTRAINT {pkey} PRIMARY KEY,
    from_endpoint text NOT NULL,
    to_endpoint text NOT NULL,
    subqueue char(1) NOT NULL DEFAULT 'I' CHECK (subqueue IN ('I', 'R', 'X', 'F')),
    insert_time timestamptz NOT NULL DEFAULT now(),
    last_processed timestamptz,
    retry_count integer NOT NULL DEFAULT 0,
    retry_time timestamptz NOT NULL DEFAULT now(),
    error_info text,
    correlation_id text,
    label text,
    msg_text text,
    msg_headers jsonb,
    unique_id text NOT NULL DEFAULT gen_random_uuid()::text,
    handling_client_id text,
    lease_expires timestamptz,
    isolated boolean NOT NULL DEFAULT false,
    priority smallint NOT NULL DEFAULT 0,
    sequence_key text,
    expires_at timestamptz
) WITH (fillfactor = 50);
CREATE INDEX {ready} ON {queue} (priority DESC, retry_time, id)
    WHERE subqueue IN ('I', 'R') AND retry_time < 'infinity';
CREATE UNIQUE INDEX {uid} ON {queue} (unique_id);
CREATE INDEX {seq} ON {queue} (sequence_key, id)
    WHERE sequence_key IS NOT NULL AND subqueue <> 'X';
CREATE INDEX {done} ON {queue} (subqueue, last_processed, id)
    WHERE subqueue IN ('X', 'F');
"""


async def create_v9_queue(db: asyncpg.Connection, schema: str, queue: str) -> None:
    """Make ``queue`` a plain queue table as schema 9 had it, registered (no rows)."""
    names = {
        role: quote_ident(own_name(queue, role)) for role in ("pkey", "ready", "uid", "seq", "done")
    }
    await db.execute(
        _V9_QUEUE.format(
            queue=f"{quote_ident(schema)}.{quote_ident(queue)}",
            id_seq=f"{quote_ident(schema)}.{quote_ident(own_name(queue, 'id_seq'))}",
            **names,
        )
    )
    await db.execute(
        f"INSERT INTO {quote_ident(schema)}.queues (name) VALUES ($1) ON CONFLICT DO NOTHING",
        queue,
    )


async def make_v9(db: asyncpg.Connection, schema: str, queues: list[str], version: int = 9) -> None:
    """Turn ``schema`` (made by this nmbus) into a version-9 one with plain ``queues``
    (or an older ``version``, from 7: their queue tables were the same)."""
    for queue in queues:
        await db.execute(f"DROP TABLE IF EXISTS {quote_ident(schema)}.{quote_ident(queue)} CASCADE")
        await db.execute(
            f"DROP TABLE IF EXISTS {quote_ident(schema)}.{quote_ident(own_name(queue, 'unique'))}"
        )
        await create_v9_queue(db, schema, queue)
    await db.execute(f"DELETE FROM {quote_ident(schema)}.schema_version")
    await db.execute(
        f"INSERT INTO {quote_ident(schema)}.schema_version (version) VALUES ($1)", version
    )
    if version < 9:  # schema 9 brought the periodic due times
        await db.execute(f'DROP TABLE {quote_ident(schema)}."periodic$due"')
