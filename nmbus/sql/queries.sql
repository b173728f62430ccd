-- Every runtime query of nmbus, by name.
--
-- A block starts with a line `-- name --`, then one comment line saying what
-- it does and what $1..$n are. Identifiers are the only dynamic part: {schema}
-- is the quoted schema, {queue} the quoted schema-qualified queue table,
-- {ready_index} / {unique_index} / {sequence_index} / {done_index} / {pkey} its quoted index and
-- constraint names
-- and {id_seq} its quoted schema-qualified identity sequence. They are filled in
-- by nmbus.sql.render(), which quotes every one; no other text is ever pasted in.
-- nmbus's own objects are named "<table>$<role>": no queue name contains '$', so
-- no queue table can ever take one of these names (see nmbus.sql.own_name).

-- advisory_lock --
-- Serialise schema changes of one schema across processes. $1: lock key text.
SELECT pg_advisory_xact_lock(hashtext($1));

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
-- Create one queue table with its indexes (idempotent).
-- fillfactor 50 leaves room on each page for the claim's UPDATE to stay HOT (it
-- changes no indexed column; see docs/storage.md); the autovacuum settings keep
-- dead tuples from piling up under a busy queue.
CREATE TABLE IF NOT EXISTS {queue} (
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
) WITH (
    fillfactor = 50,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 1
);
CREATE INDEX IF NOT EXISTS {ready_index} ON {queue} (priority DESC, retry_time, id)
    WHERE subqueue IN ('I', 'R') AND retry_time < 'infinity';
CREATE UNIQUE INDEX IF NOT EXISTS {unique_index} ON {queue} (unique_id);
CREATE INDEX IF NOT EXISTS {sequence_index} ON {queue} (sequence_key, id)
    WHERE sequence_key IS NOT NULL AND subqueue <> 'X';
CREATE INDEX IF NOT EXISTS {done_index} ON {queue} (subqueue, last_processed, id)
    WHERE subqueue IN ('X', 'F');

-- migrate_2_fillfactor --
-- Schema version 2: queue tables leave half of each page free (was 80 % full),
-- so claims stay HOT updates. Applies to pages written from now on.
ALTER TABLE {queue} SET (fillfactor = 50);

-- migrate_3_names --
-- Schema version 3: nmbus's own objects are renamed from "<table>_<role>", which a
-- queue could take ("orders_uid" left "orders" without its unique index), to
-- "<table>$<role>": the primary keys of the shared tables and, for every queue
-- table, its primary key, identity sequence and ready/uid indexes. Objects are
-- found through the catalog by the table they belong to, so a queue table named
-- like another queue's old index is never touched. Renames are catalog-only.
DO $migrate$
DECLARE
    v_nsp oid := (SELECT typnamespace FROM pg_type WHERE oid = pg_typeof(NULL::{schema}.queues));
    v_schema name := (SELECT nspname FROM pg_namespace WHERE oid = v_nsp);
    t record;
    o record;
BEGIN
    FOR t IN
        SELECT c.oid, c.relname FROM pg_class AS c
        WHERE c.relnamespace = v_nsp AND c.relkind IN ('r', 'p')
          AND (c.relname IN ('schema_version', 'queues', 'subscriptions')
               OR c.relname IN (SELECT name FROM {schema}.queues))
    LOOP
        FOR o IN
            SELECT conname AS old, 'pkey' AS role, 'CONSTRAINT' AS kind
            FROM pg_constraint WHERE conrelid = t.oid AND contype = 'p'
            UNION ALL
            SELECT s.relname, 'id_seq', 'SEQUENCE'
            FROM pg_depend AS d JOIN pg_class AS s ON s.oid = d.objid
            WHERE d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_class'::regclass
              AND d.refobjid = t.oid AND d.deptype = 'i' AND s.relkind = 'S'
            UNION ALL
            SELECT i.relname, substr(i.relname, length(t.relname) + 2), 'INDEX'
            FROM pg_index AS x JOIN pg_class AS i ON i.oid = x.indexrelid
            WHERE x.indrelid = t.oid AND NOT x.indisprimary
              AND i.relname IN (t.relname || '_ready', t.relname || '_uid')
        LOOP
            CONTINUE WHEN o.old = t.relname || '$' || o.role;
            IF o.kind = 'CONSTRAINT' THEN
                EXECUTE format('ALTER TABLE %I.%I RENAME CONSTRAINT %I TO %I',
                               v_schema, t.relname, o.old, t.relname || '$' || o.role);
            ELSE
                EXECUTE format('ALTER %s %I.%I RENAME TO %I',
                               o.kind, v_schema, o.old, t.relname || '$' || o.role);
            END IF;
        END LOOP;
    END LOOP;
END
$migrate$;

-- migrate_3_queue --
-- Schema version 3, per queue table, after migrate_3_names: unique_id gets a
-- default, so an operator can add a message with a plain INSERT (catalog-only);
-- and the indexes a name collision kept from being created under version 2 are
-- built (a queue "ship_ready" created first left "ship" without its ready index).
ALTER TABLE {queue} ALTER COLUMN unique_id SET DEFAULT gen_random_uuid()::text;
CREATE INDEX IF NOT EXISTS {ready_index} ON {queue} (retry_time, id)
    WHERE subqueue IN ('I', 'R');
CREATE UNIQUE INDEX IF NOT EXISTS {unique_index} ON {queue} (unique_id);

-- migrate_4_isolated --
-- Schema version 4: `isolated` marks a lease taken for one row alone, after a
-- crash, so that the next crash is blamed on that row only (no table rewrite).
ALTER TABLE {queue} ADD COLUMN IF NOT EXISTS isolated boolean NOT NULL DEFAULT false;

-- migrate_5_delivery --
-- Schema version 5 (docs/delivery.md): priority, ordered sequences and expiry.
-- The three columns are catalog-only (constant defaults, no table rewrite). The
-- ready index gains priority as its first key, so the claim still reads it in
-- order; it is rebuilt under the name it had (this locks the queue table while it
-- builds: a queue of many I/R rows takes as long as CREATE INDEX on them). Rows
-- with retry_time 'infinity' (never due: a sequence member parked behind an
-- earlier one, or written so by hand) are left out of it. The sequence index
-- holds only members of a sequence not yet in X.
ALTER TABLE {queue}
    ADD COLUMN IF NOT EXISTS priority smallint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS sequence_key text,
    ADD COLUMN IF NOT EXISTS expires_at timestamptz;
DROP INDEX IF EXISTS {schema}.{ready_index};
CREATE INDEX {ready_index} ON {queue} (priority DESC, retry_time, id)
    WHERE subqueue IN ('I', 'R') AND retry_time < 'infinity';
CREATE INDEX IF NOT EXISTS {sequence_index} ON {queue} (sequence_key, id)
    WHERE sequence_key IS NOT NULL AND subqueue <> 'X';

-- migrate_6_routes --
-- Schema version 6 (docs/routes.md): the outbox of messages bound for queues in
-- other databases, and subscriptions that remember a subscriber living in
-- another database (its copies go through the outbox, never into a local table).
-- A queue table already named "outbox" stops the migration: rename it first.
DO $check$
BEGIN
    IF EXISTS (SELECT 1 FROM {schema}.queues WHERE name = 'outbox') THEN
        RAISE EXCEPTION 'a queue named "outbox" exists; schema version 6 needs that name for the outbox table (rename the queue first)';
    END IF;
END
$check$;
ALTER TABLE {schema}.subscriptions
    ADD COLUMN IF NOT EXISTS subscriber_remote boolean NOT NULL DEFAULT false;
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
-- migrate_7_done --
-- Schema version 7 (docs/dashboard.md): the done index holds the X and F rows by
-- when they were processed, so the operations layer reads the last minutes of a
-- queue, and its failed rows, without scanning every processed row. The finish
-- that moves a row to X or F changes indexed columns already (it is never a HOT
-- update), so this adds one index entry to it. Built while the queue table is
-- locked against writes, like any CREATE INDEX: on a queue of millions of X rows
-- it takes as long as that (see docs/dashboard.md, "Upgrading").
CREATE INDEX IF NOT EXISTS {done_index} ON {queue} (subqueue, last_processed, id)
    WHERE subqueue IN ('X', 'F');

-- migrate_8_saga_instance --
-- Schema version 8 (docs/sagas.md): every saga table ("<endpoint>$saga") gets the
-- instance column, so that a timeout acts only on the saga instance that set it.
-- Nullable and without a default: catalog-only, no table rewrite. Rows already
-- there get their instance at their next save; a timeout sent before the upgrade
-- carries none and is handled as before.
DO $migrate$
DECLARE
    v_nsp oid := (SELECT typnamespace FROM pg_type WHERE oid = pg_typeof(NULL::{schema}.queues));
    v_schema name := (SELECT nspname FROM pg_namespace WHERE oid = v_nsp);
    t record;
BEGIN
    FOR t IN
        SELECT c.relname FROM pg_class AS c
        WHERE c.relnamespace = v_nsp AND c.relkind = 'r' AND c.relname LIKE '%$saga'
          AND EXISTS (SELECT 1 FROM pg_attribute AS a
                      WHERE a.attrelid = c.oid AND a.attname = 'saga_key' AND NOT a.attisdropped)
    LOOP
        EXECUTE format('ALTER TABLE %I.%I ADD COLUMN IF NOT EXISTS instance uuid',
                       v_schema, t.relname);
    END LOOP;
END
$migrate$;

-- migrate_9_periodic_due --
-- Schema version 9 (docs/delivery.md, periodic messages): the latest due time
-- enqueued per endpoint and schedule, which retention never removes, so a tick
-- runs once per due time even after retention removed its row. Named with a '$',
-- which no queue name contains, so no queue can already hold the name.
CREATE TABLE IF NOT EXISTS {schema}."periodic$due" (
    endpoint text NOT NULL,
    schedule text NOT NULL,
    last_due timestamptz NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT "periodic$due$pkey" PRIMARY KEY (endpoint, schedule)
);

-- register_queue --
-- Remember that queue $1 exists, so tools can list every queue.
INSERT INTO {schema}.queues (name) VALUES ($1) ON CONFLICT DO NOTHING;

-- queue_exists --
-- Whether the queue table exists. $1: schema name, $2: queue name (both unquoted).
SELECT to_regclass(format('%I.%I', $1::text, $2::text)) IS NOT NULL;

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
-- Drop a queue table.
DROP TABLE IF EXISTS {queue};

-- forget_queue --
-- Remove queue $1 from the registry.
DELETE FROM {schema}.queues WHERE name = $1;

-- insert_messages --
-- Insert messages given as parallel arrays, skipping unique_ids already stored,
-- and wake the queue's workers once. $1 from_endpoint, $2 to_endpoint,
-- $3 deliver_at[], $4 correlation_id[], $5 label[], $6 msg_text[],
-- $7 msg_headers[] (JSON text), $8 unique_id[], $9 notify channel,
-- $10 priority[], $11 sequence_key[], $12 expires_at[].
-- Rows are inserted in array order, so members of a sequence get ids in send order.
-- A member behind an earlier member not in X is parked: retry_time 'infinity',
-- out of the ready index, until the finish that moves its predecessor to X (or
-- release_sequences) makes it due. Its deliver_at is then not kept.
-- Returns how many rows were inserted.
WITH ins AS (
    INSERT INTO {queue} (from_endpoint, to_endpoint, subqueue, retry_time,
                         correlation_id, label, msg_text, msg_headers, unique_id,
                         priority, sequence_key, expires_at)
    SELECT $1, $2,
           CASE WHEN v.deliver_at > now() THEN 'R' ELSE 'I' END,
           CASE WHEN v.sequence_key IS NOT NULL AND (
                    row_number() OVER (PARTITION BY v.sequence_key ORDER BY v.ord) > 1
                    OR EXISTS (SELECT 1 FROM {queue} AS e
                               WHERE e.sequence_key = v.sequence_key AND e.subqueue <> 'X'))
                THEN 'infinity'::timestamptz
                ELSE greatest(coalesce(v.deliver_at, now()), now()) END,
           v.correlation_id, v.label, v.msg_text, v.msg_headers::jsonb, v.unique_id,
           v.priority, v.sequence_key, v.expires_at
    FROM unnest($3::timestamptz[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[],
                $10::smallint[], $11::text[], $12::timestamptz[]) WITH ORDINALITY
         AS v(deliver_at, correlation_id, label, msg_text, msg_headers, unique_id,
              priority, sequence_key, expires_at, ord)
    ORDER BY v.ord
    ON CONFLICT (unique_id) DO NOTHING
    RETURNING 1
)
SELECT count(*) AS inserted, pg_notify($9, $2) FROM ins;

-- insert_tick --
-- Enqueue the tick of schedule $8 due at $9 into endpoint $1's own queue, unless a
-- tick of that schedule due at $9 or later was enqueued before, and record $9 as
-- its latest due time: one statement, so the record and the row commit together.
-- Two processes trying the same due time serialise on the record's row; the
-- second finds last_due = $9 and inserts nothing. A record more than a minute
-- ahead of the database's clock (a process whose clock ran ahead) is not trusted:
-- any due time replaces it, so that process cannot stop the schedule for the
-- others until their clocks catch up. The unique index still keeps a
-- row whose tick was enqueued before the record existed. $2 correlation_id,
-- $3 label, $4 msg_text, $5 msg_headers (JSON text), $6 unique_id, $7 notify
-- channel. Returns how many rows were inserted (0 or 1).
WITH due AS (
    INSERT INTO {schema}."periodic$due" AS d (endpoint, schedule, last_due)
    VALUES ($1, $8, $9)
    ON CONFLICT (endpoint, schedule) DO UPDATE
        SET last_due = excluded.last_due, recorded_at = now()
        WHERE d.last_due < excluded.last_due OR d.last_due > now() + interval '1 minute'
    RETURNING 1
), ins AS (
    INSERT INTO {queue} (from_endpoint, to_endpoint, correlation_id, label, msg_text,
                         msg_headers, unique_id)
    SELECT $1, $1, $2, $3, $4, $5::jsonb, $6
    WHERE EXISTS (SELECT 1 FROM due)
    ON CONFLICT (unique_id) DO NOTHING
    RETURNING 1
)
SELECT count(*) AS inserted, pg_notify($7, $1) FROM ins;

-- claim --
-- Claim up to $1 ready rows (I, or R that is due) that no live lease holds,
-- for client $2 with a lease of $3 seconds; counts the attempt (saturating, so
-- a hand-written retry_count cannot overflow the claim). `recovered`: 0 fresh,
-- 1 let go by `isolate` to be tried alone, 2 the holder's lease ran out with
-- the row in a batch, 3 it ran out with the row isolated (the holder died on it).
-- Highest priority first, then ready-time order. A member of a sequence is
-- ready only when every earlier member (lower id, same sequence_key) is in X,
-- i.e. it is the lowest member not in X: so at most one member of a sequence is
-- ever held, and R and F members hold the rest back. That is checked only for
-- rows with a sequence_key, by one probe of the sequence index; the members
-- behind a head are parked out of the ready index anyway (see insert_messages).
-- `expired`: the row's expires_at has passed; the worker records it without
-- running a handler.
WITH ready AS (
    SELECT id, CASE WHEN lease_expires IS NULL THEN 0
                    WHEN handling_client_id IS NULL THEN 1
                    WHEN isolated THEN 3
                    ELSE 2 END AS recovered
    FROM {queue} AS r
    WHERE subqueue IN ('I', 'R') AND retry_time <= now() AND retry_time < 'infinity'
      AND (lease_expires IS NULL OR lease_expires < now())
      AND (r.sequence_key IS NULL OR r.id = (
          SELECT e.id FROM {queue} AS e
          WHERE e.sequence_key = r.sequence_key AND e.subqueue <> 'X'
          ORDER BY e.sequence_key, e.id LIMIT 1))
    ORDER BY priority DESC, retry_time, id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE {queue} AS q
SET retry_count = least(q.retry_count, 2147483646) + 1,
    isolated = false,
    handling_client_id = $2,
    lease_expires = now() + make_interval(secs => $3)
FROM ready
WHERE q.id = ready.id
RETURNING q.id, q.from_endpoint, q.insert_time, q.retry_count, q.retry_time,
          q.correlation_id, q.label, q.msg_text, q.msg_headers::text, q.unique_id,
          ready.recovered, q.priority, coalesce(q.expires_at <= now(), false);

-- finish --
-- Record the outcome of a claimed batch in one statement. Per row:
-- $1 id[], $2 new subqueue[] (X, R, F, or NULL to release it unchanged),
-- $3 retry delay seconds[] (for R), $4 error_info[] (NULL keeps the old one),
-- $5 attempt correction[] (-1 when the attempt must not count). $6 client id.
-- Only rows still leased by $6 change; returns how many did. A sequence member
-- moved to X unparks the next member of its sequence (see insert_messages).
WITH done AS (
    UPDATE {queue} AS q
    SET subqueue = coalesce(v.subqueue, q.subqueue),
        last_processed = CASE WHEN v.subqueue IS NULL THEN q.last_processed
                              ELSE clock_timestamp() END,
        retry_time = CASE WHEN v.subqueue = 'R'
                          THEN clock_timestamp() + make_interval(secs => v.delay)
                          ELSE q.retry_time END,
        error_info = coalesce(v.error_info, q.error_info),
        retry_count = greatest(0, q.retry_count + v.correction),
        handling_client_id = NULL,
        lease_expires = NULL
    FROM unnest($1::bigint[], $2::text[], $3::float8[], $4::text[], $5::int[])
         AS v(id, subqueue, delay, error_info, correction)
    WHERE q.id = v.id AND q.handling_client_id = $6
    RETURNING q.id, q.subqueue, q.sequence_key
),
unparked AS (
    -- The next member of each sequence a row of `done` moved to X becomes due now.
    UPDATE {queue} AS s SET retry_time = now()
    FROM done AS d,
         LATERAL (SELECT n.id FROM {queue} AS n
                  WHERE n.sequence_key = d.sequence_key AND n.id > d.id AND n.subqueue <> 'X'
                  ORDER BY n.sequence_key, n.id LIMIT 1) AS nxt
    WHERE d.sequence_key IS NOT NULL AND d.subqueue = 'X'
      AND s.id = nxt.id AND s.retry_time = 'infinity'
    RETURNING 1
)
SELECT count(*) FROM done;

-- finish_claim --
-- finish (same $1..$6) and, in the same statement and commit, claim the next
-- batch: up to $7 ready rows for client $6 with a lease of $8 seconds, as claim
-- does, never one of the rows being finished. Saves a round trip and a commit
-- per batch. The statement's snapshot still sees the finished rows as they
-- were, so a sequence member whose predecessor this statement moves to X is
-- let through by reading `done` (only rows really changed, i.e. still leased).
-- One row per claimed message, with the count of finished rows in `finished`;
-- a single row of NULLs beside it when nothing was claimed.
WITH done AS (
    UPDATE {queue} AS q
    SET subqueue = coalesce(v.subqueue, q.subqueue),
        last_processed = CASE WHEN v.subqueue IS NULL THEN q.last_processed
                              ELSE clock_timestamp() END,
        retry_time = CASE WHEN v.subqueue = 'R'
                          THEN clock_timestamp() + make_interval(secs => v.delay)
                          ELSE q.retry_time END,
        error_info = coalesce(v.error_info, q.error_info),
        retry_count = greatest(0, q.retry_count + v.correction),
        handling_client_id = NULL,
        lease_expires = NULL
    FROM unnest($1::bigint[], $2::text[], $3::float8[], $4::text[], $5::int[])
         AS v(id, subqueue, delay, error_info, correction)
    WHERE q.id = v.id AND q.handling_client_id = $6
    RETURNING q.id, q.subqueue, q.sequence_key
),
unparked AS (
    -- The next member of each sequence a row of `done` moved to X becomes due now.
    UPDATE {queue} AS s SET retry_time = now()
    FROM done AS d,
         LATERAL (SELECT n.id FROM {queue} AS n
                  WHERE n.sequence_key = d.sequence_key AND n.id > d.id AND n.subqueue <> 'X'
                  ORDER BY n.sequence_key, n.id LIMIT 1) AS nxt
    WHERE d.sequence_key IS NOT NULL AND d.subqueue = 'X'
      AND s.id = nxt.id AND s.retry_time = 'infinity'
    RETURNING 1
),
ready AS (
    SELECT id, CASE WHEN lease_expires IS NULL THEN 0
                    WHEN handling_client_id IS NULL THEN 1
                    WHEN isolated THEN 3
                    ELSE 2 END AS recovered
    FROM {queue} AS r
    WHERE subqueue IN ('I', 'R') AND retry_time <= now() AND retry_time < 'infinity'
      AND (lease_expires IS NULL OR lease_expires < now())
      AND (r.sequence_key IS NULL OR r.id = (
          SELECT e.id FROM {queue} AS e
          WHERE e.sequence_key = r.sequence_key AND e.subqueue <> 'X'
            AND e.id NOT IN (SELECT done.id FROM done WHERE done.subqueue = 'X')
          ORDER BY e.sequence_key, e.id LIMIT 1))
      AND id <> ALL($1::bigint[])
    ORDER BY priority DESC, retry_time, id
    LIMIT $7
    FOR UPDATE SKIP LOCKED
),
claimed AS (
    UPDATE {queue} AS q
    SET retry_count = least(q.retry_count, 2147483646) + 1,
    isolated = false,
        handling_client_id = $6,
        lease_expires = now() + make_interval(secs => $8)
    FROM ready
    WHERE q.id = ready.id
    RETURNING q.id, q.from_endpoint, q.insert_time, q.retry_count, q.retry_time,
              q.correlation_id, q.label, q.msg_text, q.msg_headers::text, q.unique_id,
              ready.recovered, q.priority, coalesce(q.expires_at <= now(), false) AS expired
)
SELECT c.id, c.from_endpoint, c.insert_time, c.retry_count, c.retry_time,
       c.correlation_id, c.label, c.msg_text, c.msg_headers, c.unique_id, c.recovered,
       c.priority, c.expired, d.finished
FROM (SELECT count(*) AS finished FROM done) AS d
LEFT JOIN claimed AS c ON true;


-- finish_claim_processed --
-- finish_claim for the common batch where every message was processed: mark
-- rows $1 held by client $2 X, then claim up to $3 more with a lease of $4
-- seconds. No per-row outcome arrays to send or join.
WITH done AS (
    UPDATE {queue}
    SET subqueue = 'X', last_processed = clock_timestamp(),
        handling_client_id = NULL, lease_expires = NULL
    WHERE id = ANY($1::bigint[]) AND handling_client_id = $2
    RETURNING id, subqueue, sequence_key
),
unparked AS (
    -- The next member of each sequence a row of `done` moved to X becomes due now.
    UPDATE {queue} AS s SET retry_time = now()
    FROM done AS d,
         LATERAL (SELECT n.id FROM {queue} AS n
                  WHERE n.sequence_key = d.sequence_key AND n.id > d.id AND n.subqueue <> 'X'
                  ORDER BY n.sequence_key, n.id LIMIT 1) AS nxt
    WHERE d.sequence_key IS NOT NULL AND d.subqueue = 'X'
      AND s.id = nxt.id AND s.retry_time = 'infinity'
    RETURNING 1
),
ready AS (
    SELECT id, CASE WHEN lease_expires IS NULL THEN 0
                    WHEN handling_client_id IS NULL THEN 1
                    WHEN isolated THEN 3
                    ELSE 2 END AS recovered
    FROM {queue} AS r
    WHERE subqueue IN ('I', 'R') AND retry_time <= now() AND retry_time < 'infinity'
      AND (lease_expires IS NULL OR lease_expires < now())
      AND (r.sequence_key IS NULL OR r.id = (
          SELECT e.id FROM {queue} AS e
          WHERE e.sequence_key = r.sequence_key AND e.subqueue <> 'X'
            AND e.id NOT IN (SELECT done.id FROM done WHERE done.subqueue = 'X')
          ORDER BY e.sequence_key, e.id LIMIT 1))
      AND id <> ALL($1::bigint[])
    ORDER BY priority DESC, retry_time, id
    LIMIT $3
    FOR UPDATE SKIP LOCKED
),
claimed AS (
    UPDATE {queue} AS q
    SET retry_count = least(q.retry_count, 2147483646) + 1,
    isolated = false,
        handling_client_id = $2,
        lease_expires = now() + make_interval(secs => $4)
    FROM ready
    WHERE q.id = ready.id
    RETURNING q.id, q.from_endpoint, q.insert_time, q.retry_count, q.retry_time,
              q.correlation_id, q.label, q.msg_text, q.msg_headers::text, q.unique_id,
              ready.recovered, q.priority, coalesce(q.expires_at <= now(), false) AS expired
)
SELECT c.id, c.from_endpoint, c.insert_time, c.retry_count, c.retry_time,
       c.correlation_id, c.label, c.msg_text, c.msg_headers, c.unique_id, c.recovered,
       c.priority, c.expired, d.finished
FROM (SELECT count(*) AS finished FROM done) AS d
LEFT JOIN claimed AS c ON true;
-- renew_leases --
-- Extend the lease of rows $1 held by client $2 to $3 seconds from now. Rows
-- locked right now are skipped, never waited for: they are being finished (or
-- isolated) by this very process, whose statements lock them in another order,
-- so waiting could deadlock with it and fail its batch.
WITH held AS (
    SELECT id FROM {queue}
    WHERE id = ANY($1::bigint[]) AND handling_client_id = $2
    FOR UPDATE SKIP LOCKED
)
UPDATE {queue} AS q SET lease_expires = now() + make_interval(secs => $3)
FROM held
WHERE q.id = held.id;

-- abandon_leases --
-- Let rows $1 held by client $2 be claimed again at once. $3: how much to take
-- off retry_count (0: the attempt stays counted; 1: it never started).
UPDATE {queue}
SET lease_expires = NULL, handling_client_id = NULL, retry_count = greatest(0, retry_count - $3)
WHERE id = ANY($1::bigint[]) AND handling_client_id = $2;

-- isolate --
-- After a crash, run one suspect alone. Of rows $1 held by client $3, row $2
-- stays held and is marked isolated; the others are let go at once. $4 per
-- row: whether a row let go must still be tried alone (its mark is a lease
-- that ran out long ago). $5 per row: attempts given back to a row let go:
-- this claim's (it has not started), plus the crash's when it died in a batch
-- (nothing says it was the one that killed the worker). Returns how many rows
-- changed.
WITH done AS (
    UPDATE {queue} AS q
    SET isolated = (q.id = $2),
        retry_count = CASE WHEN q.id = $2 THEN q.retry_count
                           ELSE greatest(0, q.retry_count - v.refund) END,
        handling_client_id = CASE WHEN q.id = $2 THEN q.handling_client_id END,
        lease_expires = CASE WHEN q.id = $2 THEN q.lease_expires
                             WHEN v.mark THEN 'epoch'::timestamptz END
    FROM unnest($1::bigint[], $4::bool[], $5::int[]) AS v(id, mark, refund)
    WHERE q.id = v.id AND q.handling_client_id = $3
    RETURNING 1
)
SELECT count(*) FROM done;

-- release_sequences --
-- Make due every parked sequence head (retry_time 'infinity' though no earlier
-- member is left outside X): a race between a send and the finish of its
-- predecessor, or a purged/deleted member, can leave one so. Walks the sequence
-- index one key at a time (a loose index scan). Returns how many it released.
WITH RECURSIVE heads AS (
    (SELECT sequence_key, id FROM {queue}
     WHERE sequence_key IS NOT NULL AND subqueue <> 'X'
     ORDER BY sequence_key, id LIMIT 1)
    UNION ALL
    SELECT n.sequence_key, n.id
    FROM heads AS h,
         LATERAL (SELECT sequence_key, id FROM {queue}
                  WHERE sequence_key > h.sequence_key AND subqueue <> 'X'
                  ORDER BY sequence_key, id LIMIT 1) AS n
), released AS (
    UPDATE {queue} AS q SET retry_time = now()
    FROM heads
    WHERE q.id = heads.id AND q.retry_time = 'infinity' AND q.subqueue IN ('I', 'R')
    RETURNING 1
)
SELECT count(*) FROM released;

-- next_due --
-- Seconds until the earliest scheduled row is due, or NULL when none is; a
-- retry_time of 'infinity' (written by hand) means never.
SELECT extract(epoch FROM retry_time - now())::float8 FROM {queue}
WHERE subqueue IN ('I', 'R') AND retry_time > now() AND retry_time < 'infinity'
ORDER BY retry_time, id
LIMIT 1;

-- subqueue_counts --
-- Rows per subqueue of one queue.
SELECT subqueue, count(*) FROM {queue} GROUP BY subqueue;

-- subscribe --
-- Add or renew subscriptions of subscriber $2 to publisher $1 for types $3,
-- expiring $4 seconds from now (NULL: never). $5: the subscriber lives in
-- another database (its copies go through the outbox).
INSERT INTO {schema}.subscriptions AS s
    (publisher_endpoint, subscriber_endpoint, message_type, created_date, expiration_date,
     subscriber_remote)
SELECT $1, $2, t, now(),
       CASE WHEN $4::float8 IS NULL THEN NULL ELSE now() + make_interval(secs => $4::float8) END,
       $5
FROM unnest($3::text[]) AS t
ON CONFLICT (publisher_endpoint, message_type, subscriber_endpoint)
DO UPDATE SET expiration_date = EXCLUDED.expiration_date,
              subscriber_remote = EXCLUDED.subscriber_remote;

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
-- Whether any row is ready now or held by a worker (used to drain a queue in tests);
-- a sequence member waiting behind an earlier member is not ready.
SELECT EXISTS (
    SELECT 1 FROM {queue} AS r
    WHERE subqueue IN ('I', 'R') AND (retry_time <= now() OR handling_client_id IS NOT NULL)
      AND (r.sequence_key IS NULL OR r.id = (
          SELECT e.id FROM {queue} AS e
          WHERE e.sequence_key = r.sequence_key AND e.subqueue <> 'X'
          ORDER BY e.sequence_key, e.id LIMIT 1))
);

-- ---------------------------------------------------------------------------
-- Sagas: one table per endpoint, {saga} = "<endpoint>$saga", created when a bus
-- with sagas starts. A row per (saga name, key); a completed saga's row is
-- deleted. See docs/sagas.md.
-- ---------------------------------------------------------------------------

-- saga_table_exists --
-- Whether the saga table of the endpoint exists. $1: schema, $2: table name (both unquoted).
SELECT to_regclass(format('%I.%I', $1::text, $2::text)) IS NOT NULL;

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

-- ===========================================================================
-- Publish/subscribe (docs/pubsub.md). The fan-out runs on the server: one
-- call finds the live subscribers and stores a copy in each one's queue table.
-- ===========================================================================

-- publish_function_exists --
-- Whether the fan-out function of this version is installed. $1: schema name (unquoted).
SELECT to_regprocedure(format(
    '%I.nmbus_publish_v3(text,text,text[],text[],text[],text[],text[],text[],timestamptz[],text,smallint[],text[],timestamptz[],text[],text)',
    $1::text)) IS NOT NULL;

-- create_publish_function --
-- Install nmbus_publish_v3 (the version is in its name, so processes of an older
-- nmbus keep calling the function they know: v1 had no priority, sequence or
-- expiry, v2 no routes). Per message it takes its type chain ("a.Sub,a.Base", most specific
-- first), label, body, headers (JSON text), correlation id, publish id, delivery
-- time, priority, sequence key and expiry; copies go into each subscriber's table
-- in array order, so a sequence keeps its order in every subscriber's queue.
-- Each copy's unique_id is
-- "<publish id>/<subscriber>", so a re-published id is stored once per queue.
-- A subscriber named in $14 (the caller's routes) or whose subscription says it
-- lives in another database gets its copies in the outbox instead, woken on
-- channel $15, for the forwarder to move (docs/routes.md).
-- Returns one row per live subscriber: (subscriber, copies inserted, missing).
-- If any subscriber's queue table is missing it inserts nothing and returns only
-- the missing ones (missing = true), so the caller can create them in its own
-- transaction and call again. Wakes each subscriber with one NOTIFY.
CREATE OR REPLACE FUNCTION {schema}.nmbus_publish_v3(
    p_schema text, p_publisher text, p_chains text[], p_labels text[], p_texts text[],
    p_headers text[], p_correlations text[], p_publish_ids text[],
    p_deliver_at timestamptz[], p_channel text, p_priorities smallint[],
    p_sequences text[], p_expires timestamptz[], p_routed text[], p_outbox_channel text
) RETURNS TABLE (subscriber text, inserted bigint, missing boolean)
LANGUAGE plpgsql AS $fn$
#variable_conflict use_column
DECLARE
    v_types text[];
    v_subs text[];
    v_sub_types text[];
    v_remote boolean[];
    v_absent text[];
    i integer;
BEGIN
    SELECT array_agg(DISTINCT t) INTO v_types
    FROM unnest(p_chains) AS c(chain), unnest(string_to_array(c.chain, ',')) AS t;
    SELECT array_agg(s.sub ORDER BY s.sub), array_agg(s.types ORDER BY s.sub),
           array_agg(s.remote OR s.sub = ANY (coalesce(p_routed, ARRAY[]::text[])) ORDER BY s.sub)
    INTO v_subs, v_sub_types, v_remote
    FROM (
        SELECT subscriber_endpoint AS sub, string_agg(message_type, ',') AS types,
               bool_or(subscriber_remote) AS remote
        FROM {schema}.subscriptions
        WHERE publisher_endpoint = p_publisher AND message_type = ANY (v_types)
          AND (expiration_date IS NULL OR expiration_date > now())
        GROUP BY subscriber_endpoint
    ) AS s;
    IF v_subs IS NULL THEN
        RETURN;
    END IF;
    SELECT array_agg(x) INTO v_absent FROM unnest(v_subs, v_remote) AS u(x, remote)
    WHERE NOT remote AND to_regclass(format('%I.%I', p_schema, x)) IS NULL;
    IF v_absent IS NOT NULL THEN
        RETURN QUERY SELECT x, 0::bigint, true FROM unnest(v_absent) AS x;
        RETURN;
    END IF;
    FOR i IN 1 .. array_length(v_subs, 1) LOOP
        subscriber := v_subs[i];
        missing := false;
        IF v_remote[i] THEN
            EXECUTE format($q$
                WITH ins AS (
                    INSERT INTO %1$I.outbox (to_endpoint, from_endpoint, deliver_at,
                                             correlation_id, label, msg_text, msg_headers,
                                             unique_id, priority, sequence_key, expires_at)
                    SELECT $2, $1, v.deliver_at, v.correlation_id, v.label, v.msg_text,
                           v.msg_headers::jsonb, v.publish_id || '/' || $2,
                           coalesce(v.priority, 0), v.sequence_key, v.expires_at
                    FROM unnest($3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
                                $8::text[], $9::timestamptz[], $11::smallint[], $12::text[],
                                $13::timestamptz[]) WITH ORDINALITY
                         AS v(chain, label, msg_text, msg_headers, correlation_id, publish_id,
                              deliver_at, priority, sequence_key, expires_at, ord)
                    WHERE string_to_array(v.chain, ',') && $10::text[]
                    ORDER BY v.ord
                    ON CONFLICT (to_endpoint, unique_id) DO NOTHING
                    RETURNING 1
                )
                SELECT count(*) FROM ins
            $q$, p_schema)
            INTO inserted
            USING p_publisher, subscriber, p_chains, p_labels, p_texts, p_headers,
                  p_correlations, p_publish_ids, p_deliver_at,
                  string_to_array(v_sub_types[i], ','), p_priorities, p_sequences, p_expires;
            IF inserted > 0 THEN
                PERFORM pg_notify(p_outbox_channel, subscriber);
            END IF;
            RETURN NEXT;
            CONTINUE;
        END IF;
        EXECUTE format($q$
            WITH ins AS (
                INSERT INTO %1$I.%2$I (from_endpoint, to_endpoint, subqueue, retry_time,
                                   correlation_id, label, msg_text, msg_headers, unique_id,
                                   priority, sequence_key, expires_at)
                SELECT $1, $2,
                       CASE WHEN v.deliver_at > now() THEN 'R' ELSE 'I' END,
                       CASE WHEN v.sequence_key IS NOT NULL AND (
                                row_number() OVER (PARTITION BY v.sequence_key ORDER BY v.ord) > 1
                                OR EXISTS (SELECT 1 FROM %1$I.%2$I AS e
                                           WHERE e.sequence_key = v.sequence_key
                                             AND e.subqueue <> 'X'))
                            THEN 'infinity'::timestamptz
                            ELSE greatest(coalesce(v.deliver_at, now()), now()) END,
                       v.correlation_id, v.label, v.msg_text, v.msg_headers::jsonb,
                       v.publish_id || '/' || $2, coalesce(v.priority, 0), v.sequence_key,
                       v.expires_at
                FROM unnest($3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
                            $8::text[], $9::timestamptz[], $11::smallint[], $12::text[],
                            $13::timestamptz[]) WITH ORDINALITY
                     AS v(chain, label, msg_text, msg_headers, correlation_id, publish_id,
                          deliver_at, priority, sequence_key, expires_at, ord)
                WHERE string_to_array(v.chain, ',') && $10::text[]
                ORDER BY v.ord
                ON CONFLICT (unique_id) DO NOTHING
                RETURNING 1
            )
            SELECT count(*) FROM ins
        $q$, p_schema, subscriber)
        INTO inserted
        USING p_publisher, subscriber, p_chains, p_labels, p_texts, p_headers,
              p_correlations, p_publish_ids, p_deliver_at,
              string_to_array(v_sub_types[i], ','), p_priorities, p_sequences, p_expires;
        IF inserted > 0 THEN
            PERFORM pg_notify(p_channel, subscriber);
        END IF;
        missing := false;
        RETURN NEXT;
    END LOOP;
END
$fn$;

-- publish --
-- Fan messages out to every live subscriber of publisher $2 (see
-- create_publish_function for $1..$15). One row per subscriber.
SELECT subscriber, inserted, missing
FROM {schema}.nmbus_publish_v3($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13,
                               $14, $15);

-- outbox_insert --
-- Store messages for queue $2, which lives in another database, in the outbox of
-- this one (same arguments as insert_messages; $9 is the outbox channel), in the
-- caller's transaction; a unique_id already waiting for that queue is skipped.
-- The forwarder (nmbus/postgres/forwarder.py) moves the rows. Returns how many
-- rows were stored.
WITH ins AS (
    INSERT INTO {schema}.outbox (to_endpoint, from_endpoint, deliver_at, correlation_id,
                                 label, msg_text, msg_headers, unique_id, priority,
                                 sequence_key, expires_at)
    SELECT $2, $1, v.deliver_at, v.correlation_id, v.label, v.msg_text, v.msg_headers::jsonb,
           v.unique_id, v.priority, v.sequence_key, v.expires_at
    FROM unnest($3::timestamptz[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[],
                $10::smallint[], $11::text[], $12::timestamptz[]) WITH ORDINALITY
         AS v(deliver_at, correlation_id, label, msg_text, msg_headers, unique_id,
              priority, sequence_key, expires_at, ord)
    ORDER BY v.ord
    ON CONFLICT (to_endpoint, unique_id) DO NOTHING
    RETURNING 1
)
SELECT count(*) AS inserted, pg_notify($9, $2) FROM ins;

-- outbox_lock --
-- Become the one forwarder of a destination queue until this transaction ends,
-- or learn that another one is. $1: lock key text.
SELECT pg_try_advisory_xact_lock(hashtext($1));

-- outbox_take --
-- The oldest $2 outbox rows bound for queue $1, in the order they were written.
SELECT id, from_endpoint, deliver_at, correlation_id, label, msg_text, msg_headers::text,
       unique_id, priority, sequence_key, expires_at
FROM {schema}.outbox
WHERE to_endpoint = $1
ORDER BY id
LIMIT $2
FOR UPDATE;

-- outbox_done --
-- Forget outbox rows $1, once the remote transaction that stored them committed.
DELETE FROM {schema}.outbox WHERE id = ANY($1::bigint[]);

-- outbox_pending --
-- Destination queues with rows waiting in the outbox.
SELECT DISTINCT to_endpoint FROM {schema}.outbox;

-- database_identity --
-- What tells this database apart from every other (a route's DSN that reaches the
-- sender's own database is refused): its oid, its server's start time and port.
SELECT d.oid::bigint, pg_postmaster_start_time(), current_setting('port')
FROM pg_database AS d WHERE d.datname = current_database();

-- purge_expired_subscriptions --
-- Delete subscriptions that expired more than $1 seconds ago (their subscriber is gone).
DELETE FROM {schema}.subscriptions
WHERE expiration_date < now() - make_interval(secs => $1::float8);

-- ---------------------------------------------------------------------------
-- Operations: status, failed messages, subscriptions, retention (nmbus/cli,
-- nmbus/retention.py). Readers never take more than ROW EXCLUSIVE on a queue;
-- writers touch only F or X rows, which no worker claims.
-- ---------------------------------------------------------------------------

-- ops_queue_status --
-- One pass over a queue: rows per subqueue, rows held by a worker, age in seconds of the oldest row waiting to be claimed, average/p99 latency (ms) and count of rows processed in the last $1 seconds.
SELECT count(*) FILTER (WHERE subqueue = 'I') AS ready,
       count(*) FILTER (WHERE subqueue = 'R') AS scheduled,
       count(*) FILTER (WHERE subqueue = 'X') AS processed,
       count(*) FILTER (WHERE subqueue = 'F') AS failed,
       count(*) FILTER (WHERE subqueue IN ('I', 'R') AND handling_client_id IS NOT NULL)
           AS in_flight,
       extract(epoch FROM now() - min(retry_time)
           FILTER (WHERE subqueue IN ('I', 'R') AND retry_time <= now()
                   AND (lease_expires IS NULL OR lease_expires < now())))::float8
           AS oldest_ready_seconds,
       count(*) FILTER (WHERE subqueue = 'X'
           AND last_processed > now() - make_interval(secs => $1)) AS recent_processed,
       (avg(extract(epoch FROM last_processed - retry_time) * 1000)
           FILTER (WHERE subqueue = 'X' AND last_processed > now() - make_interval(secs => $1))
       )::float8 AS recent_avg_ms,
       (percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM last_processed - retry_time) * 1000)
           FILTER (WHERE subqueue = 'X' AND last_processed > now() - make_interval(secs => $1))
       )::float8 AS recent_p99_ms,
       count(*) FILTER (WHERE subqueue = 'F' AND last_processed > now() - make_interval(secs => $1))
           AS recent_failed
FROM {queue};

-- ops_outbox_status --
-- The outbox's backlog per destination queue: rows waiting, the age in seconds
-- of the oldest (the forwarding lag), and when it was written.
SELECT to_endpoint AS queue, count(*) AS waiting,
       extract(epoch FROM now() - min(insert_time))::float8 AS oldest_seconds
FROM {schema}.outbox
GROUP BY to_endpoint
ORDER BY to_endpoint;
-- ops_queue_counts --
-- The cheap figures of a queue, never a scan of its X rows. $1: schema, $2: queue name (both unquoted). I and R rows are read through the ready index (and the sequence index for members parked at retry_time 'infinity'), so their cost follows the backlog; F rows through the done index. live_rows is the statistics system's count of live rows (pg_stat_user_tables.n_live_tup, kept up to date by every insert and delete, not by a scan) and pages the table's current size, from which X is estimated.
WITH open AS (
    SELECT subqueue, handling_client_id, retry_time, lease_expires
    FROM {queue} WHERE subqueue IN ('I', 'R') AND retry_time < 'infinity'
    UNION ALL
    SELECT subqueue, handling_client_id, retry_time, lease_expires
    FROM {queue}
    WHERE sequence_key IS NOT NULL AND subqueue <> 'X' AND retry_time = 'infinity'
      AND subqueue IN ('I', 'R')
)
SELECT count(*) FILTER (WHERE subqueue = 'I') AS ready,
       count(*) FILTER (WHERE subqueue = 'R') AS scheduled,
       count(*) FILTER (WHERE handling_client_id IS NOT NULL) AS in_flight,
       extract(epoch FROM now() - min(retry_time)
           FILTER (WHERE retry_time <= now()
                   AND (lease_expires IS NULL OR lease_expires < now())))::float8
           AS oldest_ready_seconds,
       (SELECT count(*) FROM {queue} WHERE subqueue = 'F') AS failed,
       (SELECT coalesce(max(n_live_tup), 0) FROM pg_stat_user_tables
        WHERE schemaname = $1 AND relname = $2) AS live_rows,
       (pg_relation_size(format('%I.%I', $1::text, $2::text)::regclass)
        / current_setting('block_size')::bigint) AS pages
FROM open;

-- ops_queue_sizes --
-- Every registered queue that has a table, by name: the statistics system's live-row count (as in ops_queue_counts), its size in pages and its table's comment (the mark of a queue a send created, see mark_created_by_send). $1: schema (unquoted).
SELECT q.name, coalesce(s.n_live_tup, 0) AS live_rows,
       pg_relation_size(c.oid) / current_setting('block_size')::bigint AS pages,
       obj_description(c.oid, 'pg_class') AS note
FROM {schema}.queues AS q
JOIN pg_namespace AS n ON n.nspname = $1
JOIN pg_class AS c ON c.relnamespace = n.oid AND c.relname = q.name AND c.relkind IN ('r', 'p')
LEFT JOIN pg_stat_user_tables AS s ON s.relid = c.oid
ORDER BY q.name;

-- ops_marked_queues --
-- Every table of the schema whose comment is $2 (the mark of a queue a send created, see mark_created_by_send), in one read of the catalogue whatever the number of queues. $1: schema (unquoted).
SELECT c.relname AS name
FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') AND obj_description(c.oid, 'pg_class') = $2;

-- ops_first_sender --
-- The endpoint that sent a queue's oldest message (for a queue a send created: that send, unless retention removed it); no row when the table is empty.
SELECT from_endpoint AS sender FROM {queue} ORDER BY id LIMIT 1;

-- ops_queue_depth --
-- One queue's depths, as ops_queue_counts reads them but without the statistics (see ops_queue_sizes), and how many sequences are blocked (at most $1). Admin.queue_depths reads many queues in one statement: a UNION ALL of this block, one per queue, each under its position in the list.
WITH open AS (
    SELECT subqueue, handling_client_id, retry_time, lease_expires
    FROM {queue} WHERE subqueue IN ('I', 'R') AND retry_time < 'infinity'
    UNION ALL
    SELECT subqueue, handling_client_id, retry_time, lease_expires
    FROM {queue}
    WHERE sequence_key IS NOT NULL AND subqueue <> 'X' AND retry_time = 'infinity'
      AND subqueue IN ('I', 'R')
)
SELECT count(*) FILTER (WHERE subqueue = 'I') AS ready,
       count(*) FILTER (WHERE subqueue = 'R') AS scheduled,
       count(*) FILTER (WHERE handling_client_id IS NOT NULL) AS in_flight,
       extract(epoch FROM now() - min(retry_time)
           FILTER (WHERE retry_time <= now()
                   AND (lease_expires IS NULL OR lease_expires < now())))::float8
           AS oldest_ready_seconds,
       (SELECT count(*) FROM {queue} WHERE subqueue = 'F') AS failed,
       (SELECT count(*) FROM (
            SELECT 1 FROM (
                SELECT DISTINCT ON (sequence_key) id, subqueue, retry_time
                FROM {queue}
                WHERE sequence_key IS NOT NULL AND subqueue <> 'X'
                ORDER BY sequence_key, id
            ) AS h
            WHERE h.subqueue = 'F' OR (h.subqueue = 'R' AND h.retry_time > now())
            LIMIT $1) AS b) AS blocked
FROM open;

-- ops_rows_estimate --
-- Rows of the given queue tables together, estimated without a scan: per table the larger of the statistics system's live rows (pg_stat_user_tables.n_live_tup: current on a primary, but zero after a crash, a stats reset, or on a standby) and the planner's row count (pg_class.reltuples: as of the last vacuum or analyze, replicated, -1 before the first). The larger one errs towards a big run. $1: schema, $2: queue names (both unquoted).
SELECT coalesce(sum(greatest(coalesce(s.n_live_tup, 0), c.reltuples::bigint, 0)), 0)::bigint
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE n.nspname = $1 AND c.relname = ANY($2::text[]) AND c.relkind IN ('r', 'p');

-- ops_count_processed --
-- How many X rows a queue holds, exactly: a walk of the X part of the done index (for small tables only; see ops_queue_counts).
SELECT count(*) FROM {queue} WHERE subqueue = 'X';

-- ops_window --
-- The last $1 seconds of a queue, read through the done index, newest first and at most $2 rows of X: how many rows went to X, the oldest last_processed among them (where the read stopped, when it reached $2), their queue latency (last_processed - retry_time) average and p50/p95/p99 in ms, and how many went to F (at most $2) over the same span: the whole window, or only since that oldest X row when the read stopped there, so a failure rate compares like with like.
WITH x AS (
    SELECT last_processed, extract(epoch FROM last_processed - retry_time) * 1000 AS ms
    FROM {queue}
    WHERE subqueue = 'X' AND last_processed > now() - make_interval(secs => $1::float8)
    ORDER BY last_processed DESC
    LIMIT $2
), s AS (
    SELECT count(*) AS processed,
           min(last_processed) AS since,
           avg(ms)::float8 AS avg_ms,
           (percentile_cont(0.50) WITHIN GROUP (ORDER BY ms))::float8 AS p50_ms,
           (percentile_cont(0.95) WITHIN GROUP (ORDER BY ms))::float8 AS p95_ms,
           (percentile_cont(0.99) WITHIN GROUP (ORDER BY ms))::float8 AS p99_ms
    FROM x
)
SELECT s.*,
       now() AS now,
       (SELECT count(*) FROM (
            SELECT 1 FROM {queue}
            WHERE subqueue = 'F' AND last_processed > now() - make_interval(secs => $1::float8)
              AND (s.processed < $2 OR last_processed >= s.since)
            LIMIT $2) AS f) AS failed
FROM s;

-- ops_history --
-- A queue's recent history in $2 buckets of $1 seconds, oldest first, ending with the bucket now is in: per bucket, rows that went to X (at most $3 read, so a bucket at $3 is a lower bound) with their latency p50/p95/p99 (ms), and rows that went to F (at most $3). Every bucket is one range of the done index.
WITH buckets AS (
    SELECT to_timestamp((floor(extract(epoch FROM now()) / $1::float8) - k) * $1::float8) AS start
    FROM generate_series(0, $2::int - 1) AS k
)
SELECT b.start, x.processed, x.p50_ms, x.p95_ms, x.p99_ms, f.failed
FROM buckets AS b
CROSS JOIN LATERAL (
    SELECT count(*) AS processed,
           (percentile_cont(0.50) WITHIN GROUP (ORDER BY s.ms))::float8 AS p50_ms,
           (percentile_cont(0.95) WITHIN GROUP (ORDER BY s.ms))::float8 AS p95_ms,
           (percentile_cont(0.99) WITHIN GROUP (ORDER BY s.ms))::float8 AS p99_ms
    FROM (
        SELECT extract(epoch FROM last_processed - retry_time) * 1000 AS ms
        FROM {queue}
        WHERE subqueue = 'X' AND last_processed >= b.start
          AND last_processed < b.start + make_interval(secs => $1::float8)
        LIMIT $3
    ) AS s
) AS x
CROSS JOIN LATERAL (
    SELECT count(*) AS failed FROM (
        SELECT 1 FROM {queue}
        WHERE subqueue = 'F' AND last_processed >= b.start
          AND last_processed < b.start + make_interval(secs => $1::float8)
        LIMIT $3
    ) AS s
) AS f
ORDER BY b.start;

-- ops_table_rows --
-- Rows of table $2 in schema $1 (both unquoted): the statistics system's live-row count and the table's size in pages; NULLs when there is no such table.
SELECT (SELECT n_live_tup FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = $2),
       pg_relation_size(t) / current_setting('block_size')::bigint
FROM to_regclass(format('%I.%I', $1::text, $2::text)) AS t
WHERE t IS NOT NULL;

-- ops_saga_count --
-- How many sagas of any type the endpoint's saga table holds, exactly (small tables only; see ops_table_rows).
SELECT count(*) FROM {saga};

-- ops_blocked_sequences --
-- Sequences of a queue held back by their head (the lowest id not in X): in F (blocked until an operator requeues or purges it) or in R (waiting for a retry or a deferred time). Per sequence: key, blocking_id, its subqueue, attempts, retry_time, members waiting behind it, error (first line of error_info, at most 1 000 characters). F first, then oldest head; at most $1 rows. Walks the sequence index only.
SELECT h.sequence_key, h.id AS blocking_id, h.subqueue, h.retry_count AS attempts, h.retry_time,
       (SELECT count(*) FROM {queue} AS w
        WHERE w.sequence_key = h.sequence_key AND w.id > h.id AND w.subqueue <> 'X') AS waiting,
       left(split_part(coalesce(h.error_info, ''), E'\n', 1), 1000) AS error
FROM (
    SELECT DISTINCT ON (sequence_key) sequence_key, id, subqueue, retry_count, retry_time,
           error_info
    FROM {queue}
    WHERE sequence_key IS NOT NULL AND subqueue <> 'X'
    ORDER BY sequence_key, id
) AS h
WHERE h.subqueue = 'F' OR (h.subqueue = 'R' AND h.retry_time > now())
ORDER BY h.subqueue = 'F' DESC, h.id
LIMIT $1;

-- ops_failed_list --
-- Failed rows of a queue, oldest first, optionally only type $1 (NULL: all), at most $2 rows; error is the first line of error_info.
SELECT id, label, retry_count, insert_time, last_processed,
       split_part(coalesce(error_info, ''), E'\n', 1) AS error
FROM {queue}
WHERE subqueue = 'F' AND ($1::text IS NULL OR label = $1)
ORDER BY id
LIMIT $2;

-- ops_failed_page --
-- One page of the failed rows of a queue, newest first: ids below $1 (NULL: from the newest), type $2 (NULL: any), error_info containing $3 (plain text, any case; NULL: any), at most $4 rows; error is the first line of error_info, at most $5 characters of it (error_cut: it was longer). F rows are read through the done index.
SELECT id, label, retry_count, insert_time, last_processed,
       left(e.line, $5) AS error, length(e.line) > $5 AS error_cut
FROM {queue}, LATERAL (SELECT split_part(coalesce(error_info, ''), E'\n', 1) AS line) AS e
WHERE subqueue = 'F' AND ($1::bigint IS NULL OR id < $1)
  AND ($2::text IS NULL OR label = $2)
  AND ($3::text IS NULL OR strpos(lower(error_info), lower($3)) > 0)
ORDER BY id DESC
LIMIT $4;

-- ops_failed_count --
-- How many failed rows match: $1 ids[] (NULL: any), $2 type (NULL: any), $3 text error_info contains (any case; NULL: any). With the highest id among them and the time of the count, which bind a later requeue or purge to the rows counted (see ops_requeue_failed).
SELECT count(*) AS n, max(id) AS max_id, clock_timestamp() AS counted_at FROM {queue}
WHERE subqueue = 'F' AND ($1::bigint[] IS NULL OR id = ANY($1::bigint[]))
  AND ($2::text IS NULL OR label = $2)
  AND ($3::text IS NULL OR strpos(lower(error_info), lower($3)) > 0);

-- ops_message --
-- Every column of row $1 of a queue (headers as JSON text); error_info, msg_text and msg_headers cut at $2 characters (NULL: whole), with their whole lengths.
SELECT id, from_endpoint, to_endpoint, subqueue, insert_time, last_processed, retry_count,
       retry_time, left(error_info, coalesce($2, length(error_info))) AS error_info,
       correlation_id, label, left(msg_text, coalesce($2, length(msg_text))) AS msg_text,
       left(msg_headers::text, coalesce($2, length(msg_headers::text))) AS msg_headers,
       unique_id, handling_client_id, lease_expires,
       coalesce(length(error_info), 0) AS error_info_chars,
       coalesce(length(msg_text), 0) AS msg_text_chars,
       coalesce(length(msg_headers::text), 0) AS msg_headers_chars
FROM {queue} WHERE id = $1;

-- ops_message_text --
-- One text column of row $1 of a queue, whole: $2 is 'error' (error_info), 'body' (msg_text) or 'headers' (msg_headers as JSON text). No row: no such message.
SELECT CASE $2::text WHEN 'error' THEN error_info WHEN 'body' THEN msg_text
                     WHEN 'headers' THEN msg_headers::text END AS text
FROM {queue} WHERE id = $1;

-- ops_requeue_failed --
-- Move up to $4 failed rows back to I as fresh messages (attempts reset, ready now, no lease; error_info kept as history) and wake the queue's workers.
-- $1 ids[] (NULL: any), $2 type (NULL: any), $3 notify channel, $4 batch size, $5 queue name (the NOTIFY payload), $6 text error_info contains (any case; NULL: any).
-- $7 highest id and $8 latest failure time (NULL: any) bind it to the rows an ops_failed_count counted: rows that failed after it stay.
WITH picked AS (
    SELECT id FROM {queue}
    WHERE subqueue = 'F' AND ($1::bigint[] IS NULL OR id = ANY($1::bigint[]))
      AND ($2::text IS NULL OR label = $2)
      AND ($6::text IS NULL OR strpos(lower(error_info), lower($6)) > 0)
      AND ($7::bigint IS NULL OR id <= $7)
      AND ($8::timestamptz IS NULL OR coalesce(last_processed, '-infinity') <= $8)
    ORDER BY id
    LIMIT $4
    FOR UPDATE SKIP LOCKED
), moved AS (
    UPDATE {queue} AS q
    SET subqueue = 'I', retry_count = 0, retry_time = now(),
        handling_client_id = NULL, lease_expires = NULL
    FROM picked WHERE q.id = picked.id
    RETURNING q.id
)
SELECT count(*) AS moved,
       CASE WHEN count(*) > 0 THEN pg_notify($3, $5) END AS notified
FROM moved;

-- ops_purge_failed --
-- Delete up to $3 failed rows. $1 ids[] (NULL: any), $2 type (NULL: any), $4 text error_info contains (any case; NULL: any), $5 and $6 as $7 and $8 of ops_requeue_failed. Returns how many.
WITH picked AS (
    SELECT id FROM {queue}
    WHERE subqueue = 'F' AND ($1::bigint[] IS NULL OR id = ANY($1::bigint[]))
      AND ($2::text IS NULL OR label = $2)
      AND ($4::text IS NULL OR strpos(lower(error_info), lower($4)) > 0)
      AND ($5::bigint IS NULL OR id <= $5)
      AND ($6::timestamptz IS NULL OR coalesce(last_processed, '-infinity') <= $6)
    ORDER BY id
    LIMIT $3
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM {queue} AS q USING picked WHERE q.id = picked.id RETURNING 1
)
SELECT count(*) FROM gone;

-- ops_subscriptions --
-- Every subscription, live or expired, optionally of publisher $1 only (NULL: all).
SELECT publisher_endpoint, subscriber_endpoint, message_type, created_date, expiration_date,
       (expiration_date IS NULL OR expiration_date > now()) AS live
FROM {schema}.subscriptions
WHERE $1::text IS NULL OR publisher_endpoint = $1
ORDER BY publisher_endpoint, message_type, subscriber_endpoint;

-- retention_lock --
-- Try to become the one retention run of a queue (session advisory lock). $1: lock key text.
SELECT pg_try_advisory_lock(hashtext($1));

-- retention_unlock --
-- Give up the retention lock taken by retention_lock. $1: lock key text.
SELECT pg_advisory_unlock(hashtext($1));

-- retention_expire --
-- Rows no worker took before they expired, long ago: up to $2 rows of I/R (not
-- held by a live lease) whose expires_at is more than $1 (interval) in the past
-- go to X, unhandled, with error_info "dropped: Expired: ..." and last_processed =
-- expires_at, so the X pass of the same run removes (or archives) them. Returns how many.
WITH picked AS (
    SELECT id FROM {queue}
    WHERE subqueue IN ('I', 'R') AND expires_at < now() - $1::interval
      AND (lease_expires IS NULL OR lease_expires < now())
    ORDER BY id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), moved AS (
    UPDATE {queue} AS q
    SET subqueue = 'X', last_processed = q.expires_at,
        error_info = 'dropped: Expired: ' || coalesce(q.label, '?')
                     || ' expired and no worker took it (removed by retention)',
        handling_client_id = NULL, lease_expires = NULL
    FROM picked WHERE q.id = picked.id
    RETURNING 1
)
SELECT count(*) FROM moved;

-- retention_count --
-- How many rows retention would remove: X processed more than $1 ago, F more than $2 ago ($2 NULL: none).
SELECT count(*) FILTER (WHERE subqueue = 'X' AND last_processed < now() - $1::interval),
       count(*) FILTER (WHERE subqueue = 'F' AND $2::interval IS NOT NULL
                        AND last_processed < now() - $2::interval)
FROM {queue};

-- retention_bounds --
-- Lowest and highest id of a queue, so retention walks it in id windows.
SELECT min(id), max(id) FROM {queue};

-- retention_pick --
-- Lock the next retention batch: rows of subqueue $1[] last processed more than $2 (interval) ago, ids in ($3, $4], lowest first, at most $5; every column, headers as JSON text.
SELECT id, from_endpoint, to_endpoint, subqueue, insert_time, last_processed, retry_count,
       retry_time, error_info, correlation_id, label, msg_text, msg_headers::text AS msg_headers,
       unique_id, handling_client_id, lease_expires, isolated, priority, sequence_key, expires_at
FROM {queue}
WHERE id > $3 AND id <= $4 AND subqueue = ANY($1::text[])
      AND last_processed < now() - $2::interval
ORDER BY id
LIMIT $5
FOR UPDATE SKIP LOCKED;

-- retention_delete --
-- Delete exactly the rows $1 (already locked by retention_pick), only while still in subqueue $2[]; returns their ids.
DELETE FROM {queue} WHERE id = ANY($1::bigint[]) AND subqueue = ANY($2::text[]) RETURNING id;

-- retention_delete_window --
-- Delete, without archiving, rows of subqueue $1[] last processed more than $2 (interval) ago, ids in ($3, $4], lowest first, at most $5; returns the highest id deleted and how many.
WITH picked AS (
    SELECT id FROM {queue}
    WHERE id > $3 AND id <= $4 AND subqueue = ANY($1::text[])
      AND last_processed < now() - $2::interval
    ORDER BY id
    LIMIT $5
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM {queue} AS q USING picked WHERE q.id = picked.id RETURNING q.id
)
SELECT max(id), count(*) FROM gone;

-- retention_present --
-- How many of the ids $1 are still in the queue (recovering an interrupted archive batch).
SELECT count(*) FROM {queue} WHERE id = ANY($1::bigint[]);
