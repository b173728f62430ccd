-- The DDL nmbus runs for schema 'nmbus' with the queue 'billing' (schema version 9).
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

INSERT INTO "nmbus".schema_version (version) VALUES ('9') ON CONFLICT DO NOTHING;

CREATE TABLE IF NOT EXISTS "nmbus"."billing" (
    id bigint GENERATED ALWAYS AS IDENTITY (SEQUENCE NAME "nmbus"."billing$id_seq")
        CONSTRAINT "billing$pkey" PRIMARY KEY,
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
CREATE INDEX IF NOT EXISTS "billing$ready" ON "nmbus"."billing" (priority DESC, retry_time, id)
    WHERE subqueue IN ('I', 'R') AND retry_time < 'infinity';
CREATE UNIQUE INDEX IF NOT EXISTS "billing$uid" ON "nmbus"."billing" (unique_id);
CREATE INDEX IF NOT EXISTS "billing$seq" ON "nmbus"."billing" (sequence_key, id)
    WHERE sequence_key IS NOT NULL AND subqueue <> 'X';
CREATE INDEX IF NOT EXISTS "billing$done" ON "nmbus"."billing" (subqueue, last_processed, id)
    WHERE subqueue IN ('X', 'F');

INSERT INTO "nmbus".queues (name) VALUES ('billing') ON CONFLICT DO NOTHING;

COMMIT;
