-- The schema: its shared tables, the queue table, the registry of queues.
--
-- Format (see nmbus/postgres/sql/__init__.py): a block starts with a line
-- `-- name --`, then comment lines saying what it does and what $1..$n are.
-- Identifiers are the only dynamic part: {schema} is the quoted schema, {queue}
-- the quoted schema-qualified queue table, {ready_index} / {unique_index} /
-- {sequence_index} / {done_index} / {pkey} its quoted index and constraint
-- names and {id_seq} its quoted schema-qualified identity sequence. They are
-- filled in by nmbus.postgres.sql.render(), which quotes every one; no other
-- text is ever pasted in. nmbus's own objects are named "<table>$<role>": no
-- queue name contains '$', so no queue table can ever take one of these names
-- (see nmbus.postgres.sql.own_name).
--
-- A new schema is made by create_schema and create_queue at the latest
-- version; an older one is brought there by the blocks in migrations/. A
-- migration that makes a table or an index the schema has names the schema's
-- fragment (outbox_table, queue_done_index, ...) rather than a copy, so it
-- makes what a new schema has; those fragments say IF NOT EXISTS, and a later
-- migration that changes what they make must say so too.

-- advisory_lock --
-- Serialise schema changes of one schema across processes. $1: lock key text.
SELECT pg_advisory_xact_lock(hashtext($1));

-- try_advisory_lock --
-- Become the one holder of lock $1 (key text) until this transaction ends, or
-- learn that another process holds it: the forwarder of a destination queue
-- (nmbus/postgres/forwarder.py), the analyze of a segment
-- (nmbus/postgres/outgrown.py).
SELECT pg_try_advisory_xact_lock(hashtext($1));

-- server_read_only --
-- Whether this session can write (a hot standby, or a server whose
-- default_transaction_read_only is on, cannot), and whether the server is a
-- standby (in recovery).
SELECT current_setting('transaction_read_only') = 'on', pg_is_in_recovery();

-- create_schema --
-- Create the schema and its shared tables (idempotent).
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {schema}.schema_version (
    version integer CONSTRAINT "schema_version$pkey" PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS {schema}.queues (
    name text CONSTRAINT "queues$pkey" PRIMARY KEY,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS {schema}.subscriptions (
    publisher_endpoint text NOT NULL,
    subscriber_endpoint text NOT NULL,
    message_type text NOT NULL,
    created_date timestamptz NOT NULL DEFAULT now(),
    expiration_date timestamptz,
    subscriber_remote boolean NOT NULL DEFAULT false,
    CONSTRAINT "subscriptions$pkey"
        PRIMARY KEY (publisher_endpoint, message_type, subscriber_endpoint)
);
{outbox_table}
{periodic_due_table}
{segment_function}
{flights_table}
{payloads_table}

-- outbox_table --
-- Fragment of create_schema and migrate_6_routes: the outbox (docs/routes.md),
-- messages bound for queues in other databases until the forwarder moves them.
CREATE TABLE IF NOT EXISTS {schema}.outbox (
    id bigint GENERATED ALWAYS AS IDENTITY (SEQUENCE NAME {schema}."outbox$id_seq")
        CONSTRAINT "outbox$pkey" PRIMARY KEY,
    to_endpoint text NOT NULL,
    from_endpoint text NOT NULL,
    insert_time timestamptz NOT NULL DEFAULT now(),
    deliver_at timestamptz,
    correlation_id text,
    label text,
    msg_text text,
    msg_headers jsonb,
    unique_id text NOT NULL DEFAULT gen_random_uuid()::text,
    priority smallint NOT NULL DEFAULT 0,
    sequence_key text,
    expires_at timestamptz,
    CONSTRAINT "outbox$uid" UNIQUE (to_endpoint, unique_id)
);
CREATE INDEX IF NOT EXISTS "outbox$queue" ON {schema}.outbox (to_endpoint, id);

-- periodic_due_table --
-- Fragment of create_schema and migrate_9_periodic_due: the latest due time
-- enqueued per endpoint and periodic schedule (docs/delivery.md).
CREATE TABLE IF NOT EXISTS {schema}."periodic$due" (
    endpoint text NOT NULL,
    schedule text NOT NULL,
    last_due timestamptz NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT "periodic$due$pkey" PRIMARY KEY (endpoint, schedule)
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
-- Create one queue table with its indexes (idempotent): a table partitioned by
-- ranges of id into segments (docs/storage.md, "Segments"; create_segment makes
-- them), each of which is dropped whole by retention once all its rows are done.
-- The indexes are declared once here and built on every segment; the queue
-- starts with segment 0 and segment 1, ready for the first roll. A unique_id
-- is kept unique by the queue's unique table (queue_unique_table), which a
-- trigger writes for every row inserted, whatever the statement.
CREATE TABLE IF NOT EXISTS {queue} (
    id bigint GENERATED ALWAYS AS IDENTITY (SEQUENCE NAME {id_seq})
        CONSTRAINT {pkey} PRIMARY KEY,
    from_endpoint text NOT NULL,
    to_endpoint text NOT NULL,
    subqueue char(1) NOT NULL DEFAULT 'I' CONSTRAINT {subqueue_check} CHECK (subqueue IN ('I', 'R', 'X', 'F')),
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
) PARTITION BY RANGE (id);
{queue_indexes}
{queue_unique_table}
SELECT {schema}.nmbus_create_segment(n.nspname, c.relname, s.n)
FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace,
     generate_series(0, 1) AS s(n)
WHERE c.oid = (SELECT typrelid FROM pg_type WHERE oid = pg_typeof(NULL::{queue})::oid);

-- queue_indexes --
-- Fragment of create_queue and migrate_10_segments: the indexes of a queue
-- table, declared on the partitioned table, so every segment has them.
CREATE INDEX IF NOT EXISTS {ready_index} ON {queue} (priority DESC, retry_time, id)
    WHERE subqueue IN ('I', 'R') AND retry_time < 'infinity';
{queue_sequence_index}
{queue_done_index}
{queue_group_index}

-- queue_unique_table --
-- Fragment of create_queue and migrate_10_segments: the queue's unique_ids, one
-- row each, with the id of the row that holds it. A partitioned table cannot have
-- a unique index that leaves out its partition key, so the one that keeps a
-- unique_id unique across segments is on this table: the trigger inserts each
-- new row's unique_id here and drops the row (as ON CONFLICT DO NOTHING would)
-- when it is already there; concurrent inserts of one unique_id wait on its
-- index entry like on any unique index. A row deleted (a purge, retention's F
-- rows) frees its unique_id (only its own entry: a row moved to a newer segment
-- has a new one already); retention deletes the entries of the segments it
-- drops (their id range, through the id index: DROP fires no trigger), but for
-- unique_for windows not yet over. An entry with a window (docs/messages.md,
-- "Unique windows") has until (unique_for) or pending (unique_while) set.
CREATE TABLE IF NOT EXISTS {unique_table} (
    unique_id text CONSTRAINT {unique_pkey} PRIMARY KEY,
    id bigint NOT NULL,
    until timestamptz,
    pending boolean
);
CREATE INDEX IF NOT EXISTS {unique_ids} ON {unique_table} (id);
{queue_unique_function}
CREATE OR REPLACE TRIGGER "nmbus$unique" BEFORE INSERT ON {queue}
    FOR EACH ROW EXECUTE FUNCTION {unique_table}();
CREATE OR REPLACE TRIGGER "nmbus$unique$free" AFTER DELETE ON {queue}
    FOR EACH ROW EXECUTE FUNCTION {unique_table}();

-- segment_function --
-- Fragment of create_schema and migrate_10_function: nmbus_create_segment(schema,
-- queue, n) creates segment n of a queue table unless it exists: the table
-- "<queue>$s<n>" for the ids from n * 2^36 (segment 0: from the lowest bigint) up
-- to (n + 1) * 2^36 (nmbus.postgres.segments). It is made empty on its own and
-- then attached, which takes the queue table in SHARE UPDATE EXCLUSIVE mode, and
-- its comment notes when ("nmbus: made <time>": a transaction older than that
-- may not see it, and the roll waits for those before new rows go to it):
-- claims, finishes and inserts go on meanwhile (CREATE TABLE ... PARTITION OF
-- would wait for every open transaction on the queue and block them all). The
-- attach builds the queue table's indexes on it and gives it its trigger.
-- fillfactor 50 leaves room on each page for the claim's UPDATE to stay HOT (it
-- changes no indexed column; see docs/storage.md); the autovacuum settings keep
-- dead tuples from piling up under a busy segment.
CREATE OR REPLACE FUNCTION {schema}.nmbus_create_segment(
    p_schema text, p_queue text, p_number bigint
) RETURNS void LANGUAGE plpgsql AS $fn$
BEGIN
    IF p_number < 0 THEN
        RAISE EXCEPTION 'no segment %', p_number;
    END IF;
    IF to_regclass(format('%I.%I', p_schema, p_queue || '$s' || p_number)) IS NOT NULL THEN
        RETURN;
    END IF;
    EXECUTE format(
        'CREATE TABLE %I.%I (LIKE %I.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS) '
        'WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0.02, '
        'autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_insert_scale_factor = 0.05, '
        'autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 1)',
        p_schema, p_queue || '$s' || p_number, p_schema, p_queue);
    EXECUTE format(
        'ALTER TABLE %I.%I ATTACH PARTITION %I.%I FOR VALUES FROM (%s) TO (%s)',
        p_schema, p_queue, p_schema, p_queue || '$s' || p_number,
        CASE WHEN p_number = 0 THEN 'MINVALUE' ELSE (p_number * 68719476736)::text END,
        (p_number + 1) * 68719476736);
    EXECUTE format('COMMENT ON TABLE %I.%I IS %L', p_schema, p_queue || '$s' || p_number,
                   'nmbus: made ' || to_char(clock_timestamp() AT TIME ZONE 'UTC',
                                             'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'));
END
$fn$;

-- create_segment --
-- Create segment $3 of queue $2 of schema $1 unless it exists (names unquoted).
SELECT {schema}.nmbus_create_segment($1, $2, $3);

-- queue_unique_index --
-- Fragment of create_queue and migrate_3_queue: one row per unique_id.
CREATE UNIQUE INDEX IF NOT EXISTS {unique_index} ON {queue} (unique_id);

-- queue_sequence_index --
-- Fragment of create_queue and migrate_5_delivery: the members of a sequence
-- not yet in X, in order, for the claim's probe of a sequence's head.
CREATE INDEX IF NOT EXISTS {sequence_index} ON {queue} (sequence_key, id)
    WHERE sequence_key IS NOT NULL AND subqueue <> 'X';

-- queue_group_index --
-- Fragment of create_queue and migrate_11_flow: the ready rows of messages sent
-- with a group (send(..., group=)), by group, for the claim that serves the
-- groups in turn (claim_fair). Rows without a group are not in it.
CREATE INDEX IF NOT EXISTS {group_index}
    ON {queue} ((msg_headers ->> 'nmbus-group'), priority DESC, retry_time, id)
    WHERE subqueue IN ('I', 'R') AND retry_time < 'infinity' AND msg_headers ? 'nmbus-group';

-- queue_done_index --
-- Fragment of create_queue and migrate_7_done: the X and F rows by when they
-- were processed, for the operations layer and retention.
CREATE INDEX IF NOT EXISTS {done_index} ON {queue} (subqueue, last_processed, id)
    WHERE subqueue IN ('X', 'F');

-- register_queue --
-- Remember that queue $1 exists, so tools can list every queue.
INSERT INTO {schema}.queues (name) VALUES ($1) ON CONFLICT DO NOTHING;

-- queue_exists --
-- Whether the queue table exists. $1: schema name, $2: queue name (both unquoted).
SELECT to_regclass(format('%I.%I', $1::text, $2::text)) IS NOT NULL;

-- readiness --
-- What a readiness check asks of a schema known to exist (nmbus/postgres/schema.py,
-- readiness_on): its version, and whether the table of queue $2 exists in it.
-- $1: schema name, $2: queue name (both unquoted).
SELECT (SELECT max(version) FROM {schema}.schema_version) AS version,
       to_regclass(format('%I.%I', $1::text, $2::text)) IS NOT NULL AS queue_exists;

-- queue_comment --
-- Whether the queue table exists, and its comment (the mark of a table a send created).
-- $1: schema name, $2: queue name (both unquoted). No row: no such table.
SELECT obj_description(c, 'pg_class') FROM to_regclass(format('%I.%I', $1::text, $2::text)) AS c
WHERE c IS NOT NULL;

-- mark_created_by_send --
-- Mark a queue table that a send created before any endpoint started on it
-- (docs/operations.md; psql's \dt+ shows it).
COMMENT ON TABLE {queue} IS 'nmbus: created by a send; no endpoint has started on it';

-- unmark_queue --
-- Clear that mark: an endpoint started on the queue, or an operator created it.
COMMENT ON TABLE {queue} IS NULL;

-- list_queues --
-- Names of all registered queues that still have a table. $1: schema name (unquoted).
SELECT name FROM {schema}.queues
WHERE to_regclass(format('%I.%I', $1::text, name)) IS NOT NULL
ORDER BY name;

-- drop_queue --
-- Drop a queue table (its segments with it) and the tables of its own: its
-- unique table with the trigger function that wrote it (kept, a queue created
-- again under the name would take the dropped queue's unique_ids for
-- duplicates).
DROP TABLE IF EXISTS {queue};
DROP TABLE IF EXISTS {unique_table};
DROP FUNCTION IF EXISTS {unique_table}();

-- forget_queue --
-- Remove queue $1 from the registry.
DELETE FROM {schema}.queues WHERE name = $1;

-- queue_unique_function --
-- Fragment of queue_unique_table and migrate_unique_function (schema versions 14
-- and 15): the trigger function of a queue's unique table. A row whose unique_id
-- is new takes the entry, with the window its headers ask for (nmbus-unique-for:
-- until its insert_time plus that many seconds; nmbus-unique-while: while it is
-- in I or R).
-- On a conflict with an entry that has no window the row is dropped at once, as
-- before. An entry with a window is locked, then checked with a fresh snapshot
-- (a volatile function's next statement): over (until passed, or its row no
-- longer in I/R or gone), the new row takes it; concurrent senders of one
-- unique_id wait on that lock, and the second sees the first's row. An entry
-- gone between the insert and the lock (its row deleted: a purge, retention)
-- holds nothing any more: the insert is tried again. A row that
-- retention moves to a newer segment (nmbus.moving set for its transaction) takes
-- the entry the same way, and is kept whether or not it does.
CREATE OR REPLACE FUNCTION {unique_table}() RETURNS trigger LANGUAGE plpgsql AS $fn$
DECLARE
    held record;
    windowed boolean;
    new_until timestamptz;
    new_pending boolean;
BEGIN
    IF TG_OP = 'DELETE' THEN
        DELETE FROM {unique_table} WHERE unique_id = OLD.unique_id AND id = OLD.id;
        RETURN OLD;
    END IF;
    IF NEW.msg_headers IS NOT NULL THEN
        new_until := NEW.insert_time
            + (NEW.msg_headers ->> 'nmbus-unique-for')::double precision * interval '1 second';
        new_pending := NULLIF(NEW.msg_headers ? 'nmbus-unique-while', false);
    END IF;
    LOOP
        INSERT INTO {unique_table} (unique_id, id, until, pending)
        VALUES (NEW.unique_id, NEW.id, new_until, new_pending)
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            RETURN NEW;
        END IF;
        SELECT u.id, u.until, u.pending INTO held FROM {unique_table} AS u
        WHERE u.unique_id = NEW.unique_id AND (u.until IS NOT NULL OR u.pending)
        FOR UPDATE;
        windowed := FOUND;
        EXIT WHEN windowed OR EXISTS (SELECT 1 FROM {unique_table} AS u
                                   WHERE u.unique_id = NEW.unique_id);
    END LOOP;
    IF NOT windowed OR held.until > now()
       OR (held.pending AND EXISTS (SELECT 1 FROM {queue} AS q
                                    WHERE q.id = held.id AND q.subqueue IN ('I', 'R'))) THEN
        IF current_setting('nmbus.moving', true) = 'on' THEN
            RETURN NEW;
        END IF;
        RETURN NULL;
    END IF;
    UPDATE {unique_table} SET id = NEW.id, until = new_until, pending = new_pending
    WHERE unique_id = NEW.unique_id;
    RETURN NEW;
END
$fn$;
