-- Sagas: one table per endpoint, {saga} = "<endpoint>$saga", created when a bus
-- with sagas starts. A row per (saga name, key); a completed saga's row is
-- deleted. See docs/sagas.md.

-- saga_table_exists --
-- Whether the saga table of the endpoint exists. $1: schema, $2: table name (both unquoted).
-- The question queue_exists asks of a queue table.
{queue_exists}

-- create_saga_table --
-- Create the endpoint's saga table (idempotent). state is NULL only inside the
-- transaction of a start message that has just created the row. instance
-- identifies one life of a saga (a saga completed and started again with the
-- same key is another instance); its timeouts carry it. It is set by the start
-- that creates the row, or by the first save of a row created without one
-- (before schema version 8, or by an older nmbus).
CREATE TABLE IF NOT EXISTS {saga} (
    saga_type text NOT NULL,
    saga_key text NOT NULL,
    state jsonb,
    version integer NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    instance uuid,
    CONSTRAINT {saga_pkey} PRIMARY KEY (saga_type, saga_key)
);

-- saga_lock_keys --
-- Before a batch's handlers run: take the transaction-level advisory locks
-- ($1[i], $2[i]) of every saga the batch's messages name, in array order (the
-- caller sorts them), so that two batches never hold one each of two sagas and
-- wait for the other's (docs/sagas.md, "Several workers"). One lock per (saga
-- table and name, key), whether its row exists yet or not; the two-key form, a
-- lock space apart from the one-key advisory_lock.
SELECT pg_advisory_xact_lock(k.a, k.b) FROM unnest($1::int4[], $2::int4[]) AS k(a, b);

-- saga_lock --
-- Lock saga $1 with key $2 until the transaction ends; no row when there is none.
SELECT state::text, version, instance::text FROM {saga}
WHERE saga_type = $1 AND saga_key = $2 FOR UPDATE;

-- saga_lock_or_create --
-- Lock saga $1 with key $2, creating it (state NULL, version 0, instance $3) when
-- missing. One statement: a concurrent creator's row is waited for and then
-- locked, never inserted twice (ON CONFLICT DO UPDATE locks the row it conflicts with).
INSERT INTO {saga} AS s (saga_type, saga_key, state, version, instance)
VALUES ($1, $2, NULL, 0, $3::text::uuid)
ON CONFLICT (saga_type, saga_key) DO UPDATE SET version = s.version
RETURNING s.state::text, s.version, s.instance::text;

-- saga_save --
-- Store state $3 (JSON text) of saga $1 with key $2, locked by this transaction; a
-- row without an instance (created before schema version 8) takes $4.
UPDATE {saga} SET state = $3::text::jsonb, version = version + 1, updated_at = now(),
    instance = coalesce(instance, $4::text::uuid)
WHERE saga_type = $1 AND saga_key = $2;

-- saga_delete --
-- Remove completed saga $1 with key $2.
DELETE FROM {saga} WHERE saga_type = $1 AND saga_key = $2;

-- saga_load --
-- The committed state of saga $1 with key $2 (no lock), as JSON text.
SELECT state::text FROM {saga} WHERE saga_type = $1 AND saga_key = $2 AND state IS NOT NULL;
