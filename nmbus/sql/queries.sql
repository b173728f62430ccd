-- Every runtime query of nmbus, by name.
--
-- A block starts with a line `-- name --`, then one comment line saying what
-- it does and what $1..$n are. Identifiers are the only dynamic part: {schema}
-- is the quoted schema, {queue} the quoted schema-qualified queue table, and
-- {ready_index} / {unique_index} quoted index names. They are filled in by
-- nmbus.sql.render(), which quotes every one; no other text is ever pasted in.

-- advisory_lock --
-- Serialise schema changes of one schema across processes. $1: lock key text.
SELECT pg_advisory_xact_lock(hashtext($1));

-- create_schema --
-- Create the schema and its shared tables (idempotent).
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {schema}.schema_version (
    version integer PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS {schema}.queues (
    name text PRIMARY KEY,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS {schema}.subscriptions (
    publisher_endpoint text NOT NULL,
    subscriber_endpoint text NOT NULL,
    message_type text NOT NULL,
    created_date timestamptz NOT NULL DEFAULT now(),
    expiration_date timestamptz,
    PRIMARY KEY (publisher_endpoint, message_type, subscriber_endpoint)
);

-- schema_version --
-- The highest schema version applied, NULL for a new schema.
SELECT max(version) FROM {schema}.schema_version;

-- set_schema_version --
-- Record that schema version $1 is applied.
INSERT INTO {schema}.schema_version (version) VALUES ($1) ON CONFLICT DO NOTHING;

-- schema_exists --
-- Whether the version table of the schema exists. $1: schema name (unquoted).
SELECT to_regclass(format('%I.schema_version', $1::text)) IS NOT NULL;

-- create_queue --
-- Create one queue table with its indexes (idempotent).
-- fillfactor leaves room on each page so the claim's UPDATE stays HOT; the
-- autovacuum settings keep dead tuples from piling up under a busy queue.
CREATE TABLE IF NOT EXISTS {queue} (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
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
    unique_id text NOT NULL,
    handling_client_id text,
    lease_expires timestamptz
) WITH (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 1
);
CREATE INDEX IF NOT EXISTS {ready_index} ON {queue} (retry_time, id)
    WHERE subqueue IN ('I', 'R');
CREATE UNIQUE INDEX IF NOT EXISTS {unique_index} ON {queue} (unique_id);

-- register_queue --
-- Remember that queue $1 exists, so tools can list every queue.
INSERT INTO {schema}.queues (name) VALUES ($1) ON CONFLICT DO NOTHING;

-- queue_exists --
-- Whether the queue table exists. $1: schema name, $2: queue name (both unquoted).
SELECT to_regclass(format('%I.%I', $1::text, $2::text)) IS NOT NULL;

-- list_queues --
-- Names of all registered queues that still have a table. $1: schema name (unquoted).
SELECT name FROM {schema}.queues
WHERE to_regclass(format('%I.%I', $1::text, name)) IS NOT NULL
ORDER BY name;

-- drop_queue --
-- Drop a queue table.
DROP TABLE IF EXISTS {queue};

-- forget_queue --
-- Remove queue $1 from the registry.
DELETE FROM {schema}.queues WHERE name = $1;

-- insert_messages --
-- Insert messages given as parallel arrays, skipping unique_ids already stored,
-- and wake the queue's workers once. $1 from_endpoint, $2 to_endpoint,
-- $3 deliver_at[], $4 correlation_id[], $5 label[], $6 msg_text[],
-- $7 msg_headers[] (JSON text), $8 unique_id[], $9 notify channel.
-- Returns how many rows were inserted.
WITH ins AS (
    INSERT INTO {queue} (from_endpoint, to_endpoint, subqueue, retry_time,
                         correlation_id, label, msg_text, msg_headers, unique_id)
    SELECT $1, $2,
           CASE WHEN v.deliver_at > now() THEN 'R' ELSE 'I' END,
           greatest(coalesce(v.deliver_at, now()), now()),
           v.correlation_id, v.label, v.msg_text, v.msg_headers::jsonb, v.unique_id
    FROM unnest($3::timestamptz[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[])
         AS v(deliver_at, correlation_id, label, msg_text, msg_headers, unique_id)
    ON CONFLICT (unique_id) DO NOTHING
    RETURNING 1
)
SELECT count(*) AS inserted, pg_notify($9, $2) FROM ins;

-- claim --
-- Claim up to $1 ready rows (I, or R that is due) that no live lease holds,
-- for client $2 with a lease of $3 seconds; counts the attempt. `recovered`
-- says the previous holder's lease ran out (it died or stalled mid-handler).
WITH ready AS (
    SELECT id, lease_expires IS NOT NULL AS recovered FROM {queue}
    WHERE subqueue IN ('I', 'R') AND retry_time <= now()
      AND (lease_expires IS NULL OR lease_expires < now())
    ORDER BY retry_time, id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE {queue} AS q
SET retry_count = q.retry_count + 1,
    handling_client_id = $2,
    lease_expires = now() + make_interval(secs => $3)
FROM ready
WHERE q.id = ready.id
RETURNING q.id, q.from_endpoint, q.insert_time, q.retry_count, q.retry_time,
          q.correlation_id, q.label, q.msg_text, q.msg_headers::text, q.unique_id,
          ready.recovered;

-- finish --
-- Record the outcome of a claimed batch in one statement. Per row:
-- $1 id[], $2 new subqueue[] (X, R, F, or NULL to release it unchanged),
-- $3 retry delay seconds[] (for R), $4 error_info[] (NULL keeps the old one),
-- $5 attempt correction[] (-1 when the attempt must not count). $6 client id.
-- Only rows still leased by $6 change; returns how many did.
WITH done AS (
    UPDATE {queue} AS q
    SET subqueue = coalesce(v.subqueue, q.subqueue),
        last_processed = CASE WHEN v.subqueue IS NULL THEN q.last_processed
                              ELSE clock_timestamp() END,
        retry_time = CASE WHEN v.subqueue = 'R'
                          THEN clock_timestamp() + make_interval(secs => v.delay)
                          ELSE q.retry_time END,
        error_info = coalesce(v.error_info, q.error_info),
        retry_count = q.retry_count + v.correction,
        handling_client_id = NULL,
        lease_expires = NULL
    FROM unnest($1::bigint[], $2::text[], $3::float8[], $4::text[], $5::int[])
         AS v(id, subqueue, delay, error_info, correction)
    WHERE q.id = v.id AND q.handling_client_id = $6
    RETURNING 1
)
SELECT count(*) FROM done;

-- renew_leases --
-- Extend the lease of rows $1 held by client $2 to $3 seconds from now.
UPDATE {queue} SET lease_expires = now() + make_interval(secs => $3)
WHERE id = ANY($1::bigint[]) AND handling_client_id = $2;

-- abandon_leases --
-- Let rows $1 held by client $2 be claimed again at once (the attempt stays counted).
UPDATE {queue} SET lease_expires = NULL, handling_client_id = NULL
WHERE id = ANY($1::bigint[]) AND handling_client_id = $2;

-- next_due --
-- Seconds until the earliest scheduled row is due, or NULL when none is.
SELECT extract(epoch FROM retry_time - now())::float8 FROM {queue}
WHERE subqueue IN ('I', 'R') AND retry_time > now()
ORDER BY retry_time, id
LIMIT 1;

-- subqueue_counts --
-- Rows per subqueue of one queue.
SELECT subqueue, count(*) FROM {queue} GROUP BY subqueue;

-- subscribe --
-- Add or renew subscriptions of subscriber $2 to publisher $1 for types $3,
-- expiring $4 seconds from now (NULL: never).
INSERT INTO {schema}.subscriptions AS s
    (publisher_endpoint, subscriber_endpoint, message_type, created_date, expiration_date)
SELECT $1, $2, t, now(),
       CASE WHEN $4::float8 IS NULL THEN NULL ELSE now() + make_interval(secs => $4::float8) END
FROM unnest($3::text[]) AS t
ON CONFLICT (publisher_endpoint, message_type, subscriber_endpoint)
DO UPDATE SET expiration_date = EXCLUDED.expiration_date;

-- unsubscribe --
-- Remove subscriptions of subscriber $2 to publisher $1 for types $3.
DELETE FROM {schema}.subscriptions
WHERE publisher_endpoint = $1 AND subscriber_endpoint = $2 AND message_type = ANY($3::text[]);

-- subscribers --
-- Live subscribers of publisher $1 for any of the type names $2.
SELECT DISTINCT subscriber_endpoint FROM {schema}.subscriptions
WHERE publisher_endpoint = $1 AND message_type = ANY($2::text[])
  AND (expiration_date IS NULL OR expiration_date > now())
ORDER BY subscriber_endpoint;

-- has_ready --
-- Whether any row is ready now or held by a worker (used to drain a queue in tests).
SELECT EXISTS (
    SELECT 1 FROM {queue}
    WHERE subqueue IN ('I', 'R') AND (retry_time <= now() OR handling_client_id IS NOT NULL)
);

-- ---------------------------------------------------------------------------
-- Soak (nmbus.soak): the kill soak's own bookkeeping, in its own schema.
-- ---------------------------------------------------------------------------

-- soak_reset --
-- Drop the soak's schema with everything in it (the soak owns that schema).
DROP SCHEMA IF EXISTS {schema} CASCADE;

-- soak_create_effects --
-- The table soak handlers write through ctx.connection: one row per committed handling.
CREATE TABLE IF NOT EXISTS {schema}.soak_effects (
    unique_id text NOT NULL,
    attempt integer NOT NULL,
    pid integer NOT NULL
);

-- soak_record_effect --
-- A soak handler's transactional effect. $1 unique_id, $2 attempt, $3 worker pid.
INSERT INTO {schema}.soak_effects (unique_id, attempt, pid) VALUES ($1, $2, $3);

-- soak_open_rows --
-- Rows of the soak queue not yet in X or F.
SELECT count(*) FROM {queue} WHERE subqueue IN ('I', 'R');

-- soak_rows --
-- Every row of the soak queue with its committed effects (unique_id, subqueue,
-- retry_count, error_info's first line, effects as (attempt, pid) pairs).
SELECT q.unique_id, q.subqueue, q.retry_count, split_part(q.error_info, E'\n', 1),
       coalesce(array_agg(e.attempt ORDER BY e.attempt) FILTER (WHERE e.attempt IS NOT NULL),
                ARRAY[]::integer[]),
       coalesce(array_agg(e.pid ORDER BY e.attempt) FILTER (WHERE e.pid IS NOT NULL),
                ARRAY[]::integer[])
FROM {queue} AS q
LEFT JOIN {schema}.soak_effects AS e ON e.unique_id = q.unique_id
GROUP BY q.unique_id, q.subqueue, q.retry_count, q.error_info;
