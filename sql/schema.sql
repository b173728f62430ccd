-- The DDL nmbus runs for schema 'nmbus' with the queue 'billing' (schema version 16).
-- nmbus creates all of this itself when a Bus starts; to run it by hand:
--   psql -v ON_ERROR_STOP=1 -f FILE

BEGIN;

CREATE SCHEMA IF NOT EXISTS "nmbus";
CREATE TABLE IF NOT EXISTS "nmbus".schema_version (
    version integer CONSTRAINT "schema_version$pkey" PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS "nmbus".queues (
    name text CONSTRAINT "queues$pkey" PRIMARY KEY,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS "nmbus".subscriptions (
    publisher_endpoint text NOT NULL,
    subscriber_endpoint text NOT NULL,
    message_type text NOT NULL,
    created_date timestamptz NOT NULL DEFAULT now(),
    expiration_date timestamptz,
    subscriber_remote boolean NOT NULL DEFAULT false,
    CONSTRAINT "subscriptions$pkey"
        PRIMARY KEY (publisher_endpoint, message_type, subscriber_endpoint)
);
CREATE TABLE IF NOT EXISTS "nmbus".outbox (
    id bigint GENERATED ALWAYS AS IDENTITY (SEQUENCE NAME "nmbus"."outbox$id_seq")
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
CREATE INDEX IF NOT EXISTS "outbox$queue" ON "nmbus".outbox (to_endpoint, id);
CREATE TABLE IF NOT EXISTS "nmbus"."periodic$due" (
    endpoint text NOT NULL,
    schedule text NOT NULL,
    last_due timestamptz NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT "periodic$due$pkey" PRIMARY KEY (endpoint, schedule)
);
CREATE OR REPLACE FUNCTION "nmbus".nmbus_create_segment(
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
CREATE TABLE IF NOT EXISTS "nmbus"."flow$flights" (
    queue text NOT NULL,
    key text NOT NULL,
    group_key text NOT NULL,
    id bigint NOT NULL,
    client text NOT NULL,
    attempt integer NOT NULL,
    claimed timestamptz NOT NULL DEFAULT clock_timestamp(),
    started timestamptz,
    CONSTRAINT "flow$flights$pkey" PRIMARY KEY (queue, key, id, attempt)
);
CREATE INDEX IF NOT EXISTS "flow$flights$claimed" ON "nmbus"."flow$flights" (queue, claimed);
CREATE TABLE IF NOT EXISTS "nmbus"."flow$limits" (
    queue text NOT NULL,
    key text NOT NULL,
    limits text NOT NULL,
    labels text[] NOT NULL,
    concurrency integer,
    starts integer,
    window_s float8,
    group_concurrency integer,
    declared_by text NOT NULL,
    declared_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT "flow$limits$pkey" PRIMARY KEY (queue, key)
);
CREATE TABLE IF NOT EXISTS "nmbus"."claim$payloads" (
    queue text NOT NULL,
    key text NOT NULL,
    body text,
    url text,
    bytes bigint NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT "claim$payloads$pkey" PRIMARY KEY (queue, key)
);

INSERT INTO "nmbus".schema_version (version) VALUES ('16') ON CONFLICT DO NOTHING;

CREATE TABLE IF NOT EXISTS "nmbus"."billing" (
    id bigint GENERATED ALWAYS AS IDENTITY (SEQUENCE NAME "nmbus"."billing$id_seq")
        CONSTRAINT "billing$pkey" PRIMARY KEY,
    from_endpoint text NOT NULL,
    to_endpoint text NOT NULL,
    subqueue char(1) NOT NULL DEFAULT 'I' CONSTRAINT "billing$subqueue" CHECK (subqueue IN ('I', 'R', 'X', 'F')),
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
CREATE INDEX IF NOT EXISTS "billing$ready" ON "nmbus"."billing" (priority DESC, retry_time, id)
    WHERE subqueue IN ('I', 'R') AND retry_time < 'infinity';
CREATE INDEX IF NOT EXISTS "billing$seq" ON "nmbus"."billing" (sequence_key, id)
    WHERE sequence_key IS NOT NULL AND subqueue <> 'X';
CREATE INDEX IF NOT EXISTS "billing$done" ON "nmbus"."billing" (subqueue, last_processed, id)
    WHERE subqueue IN ('X', 'F');
CREATE INDEX IF NOT EXISTS "billing$group"
    ON "nmbus"."billing" ((msg_headers ->> 'nmbus-group'), priority DESC, retry_time, id)
    WHERE subqueue IN ('I', 'R') AND retry_time < 'infinity' AND msg_headers ? 'nmbus-group';
CREATE TABLE IF NOT EXISTS "nmbus"."billing$unique" (
    unique_id text CONSTRAINT "billing$unique$pkey" PRIMARY KEY,
    id bigint NOT NULL,
    until timestamptz,
    pending boolean
);
CREATE INDEX IF NOT EXISTS "billing$unique$id" ON "nmbus"."billing$unique" (id);
CREATE OR REPLACE FUNCTION "nmbus"."billing$unique"() RETURNS trigger LANGUAGE plpgsql AS $fn$
DECLARE
    held record;
    windowed boolean;
    new_until timestamptz;
    new_pending boolean;
BEGIN
    IF TG_OP = 'DELETE' THEN
        DELETE FROM "nmbus"."billing$unique" WHERE unique_id = OLD.unique_id AND id = OLD.id;
        RETURN OLD;
    END IF;
    IF NEW.msg_headers IS NOT NULL THEN
        new_until := NEW.insert_time
            + (NEW.msg_headers ->> 'nmbus-unique-for')::double precision * interval '1 second';
        new_pending := NULLIF(NEW.msg_headers ? 'nmbus-unique-while', false);
    END IF;
    LOOP
        INSERT INTO "nmbus"."billing$unique" (unique_id, id, until, pending)
        VALUES (NEW.unique_id, NEW.id, new_until, new_pending)
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            RETURN NEW;
        END IF;
        SELECT u.id, u.until, u.pending INTO held FROM "nmbus"."billing$unique" AS u
        WHERE u.unique_id = NEW.unique_id AND (u.until IS NOT NULL OR u.pending)
        FOR UPDATE;
        windowed := FOUND;
        EXIT WHEN windowed OR EXISTS (SELECT 1 FROM "nmbus"."billing$unique" AS u
                                   WHERE u.unique_id = NEW.unique_id);
    END LOOP;
    IF NOT windowed OR held.until > now()
       OR (held.pending AND EXISTS (SELECT 1 FROM "nmbus"."billing" AS q
                                    WHERE q.id = held.id AND q.subqueue IN ('I', 'R'))) THEN
        IF current_setting('nmbus.moving', true) = 'on' THEN
            RETURN NEW;
        END IF;
        RETURN NULL;
    END IF;
    UPDATE "nmbus"."billing$unique" SET id = NEW.id, until = new_until, pending = new_pending
    WHERE unique_id = NEW.unique_id;
    RETURN NEW;
END
$fn$;
CREATE OR REPLACE TRIGGER "nmbus$unique" BEFORE INSERT ON "nmbus"."billing"
    FOR EACH ROW EXECUTE FUNCTION "nmbus"."billing$unique"();
CREATE OR REPLACE TRIGGER "nmbus$unique$free" AFTER DELETE ON "nmbus"."billing"
    FOR EACH ROW EXECUTE FUNCTION "nmbus"."billing$unique"();
SELECT "nmbus".nmbus_create_segment(n.nspname, c.relname, s.n)
FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace,
     generate_series(0, 1) AS s(n)
WHERE c.oid = (SELECT typrelid FROM pg_type WHERE oid = pg_typeof(NULL::"nmbus"."billing")::oid);

INSERT INTO "nmbus".queues (name) VALUES ('billing') ON CONFLICT DO NOTHING;

COMMIT;
