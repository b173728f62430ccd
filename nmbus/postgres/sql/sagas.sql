-- Sagas: one table per endpoint, {saga} = "<endpoint>$saga", created when a bus
-- with sagas starts. A row per (saga name, key); a completed saga's row is
-- deleted. See docs/sagas.md.

-- saga_table_exists --
-- Whether the saga table of the endpoint exists. $1: schema, $2: table name (both unquoted).
-- The question queue_exists asks of a queue table.
{queue_exists}

-- create_saga_table --
-- Create the endpoint's saga table (idempotent). state is NULL only in a row an
-- older nmbus created inside a start message's transaction (never committed
-- so): a saga's row is written whole when its batch commits. instance
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
-- Take the transaction-level advisory locks ($1[i], $2[i]) of sagas, waiting
-- for each, in array order (the caller sorts them), so that two waiting batches
-- never hold one each of two sagas and wait for the other's (docs/sagas.md,
-- "Several loops and processes"). One lock per (saga table and name, key),
-- whether its row exists yet or not; the two-key form, a lock space apart from
-- the one-key advisory_lock. Only a batch that holds no saga lock waits here.
SELECT pg_advisory_xact_lock(k.a, k.b) FROM unnest($1::int4[], $2::int4[]) AS k(a, b);

-- saga_try_lock_keys --
-- The same locks, without waiting: the pairs ($1[i], $2[i]) this transaction
-- holds now. A batch takes what is free and leaves the messages of the rest
-- for later in the batch, when it holds nothing (saga_lock_keys).
SELECT k.a, k.b FROM unnest($1::int4[], $2::int4[]) AS k(a, b)
WHERE pg_try_advisory_xact_lock(k.a, k.b);

-- saga_lock_rows --
-- The rows of sagas ($1[i] name, $2[i] key) whose advisory locks this
-- transaction holds, locked until it ends (against writers that take no
-- advisory lock: an operator's UPDATE). Its own statement, after the advisory
-- locks: a saga created by the batch that held one just before is seen.
SELECT s.saga_type, s.saga_key, s.state::text, s.version, s.instance::text
FROM {saga} AS s JOIN unnest($1::text[], $2::text[]) AS k(saga_type, saga_key)
    ON s.saga_type = k.saga_type AND s.saga_key = k.saga_key
FOR UPDATE OF s;

-- saga_delete_many --
-- Remove sagas ($1[i] name, $2[i] key): completed, or completed and started
-- again within the batch (saga_save_many then inserts the new one).
DELETE FROM {saga} AS s USING unnest($1::text[], $2::text[]) AS k(saga_type, saga_key)
WHERE s.saga_type = k.saga_type AND s.saga_key = k.saga_key;

-- saga_save_many --
-- Store the states of a batch's sagas, locked by this transaction: $1[i] name,
-- $2[i] key, $3[i] state (JSON text), $4[i] instance, $5[i] saves since the
-- last write (added to version). A new saga is inserted with version $5[i]; a
-- row without an instance (created before schema version 8) takes $4[i].
INSERT INTO {saga} AS s (saga_type, saga_key, state, version, instance)
SELECT k.saga_type, k.saga_key, k.state::jsonb, k.saves, k.instance::uuid
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int[])
    AS k(saga_type, saga_key, state, instance, saves)
ON CONFLICT (saga_type, saga_key) DO UPDATE
    SET state = excluded.state, version = s.version + excluded.version, updated_at = now(),
        instance = coalesce(s.instance, excluded.instance);

-- saga_load --
-- The committed state of saga $1 with key $2 (no lock), as JSON text.
SELECT state::text FROM {saga} WHERE saga_type = $1 AND saga_key = $2 AND state IS NOT NULL;
