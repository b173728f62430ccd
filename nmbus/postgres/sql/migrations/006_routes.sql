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
