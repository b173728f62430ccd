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
{outbox_table}
