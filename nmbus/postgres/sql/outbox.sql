-- Routes (docs/routes.md): messages bound for queues in other databases wait in
-- the outbox of the sender's database until the forwarder moves them.

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
    {insert_arrays}
    ORDER BY v.ord
    ON CONFLICT (to_endpoint, unique_id) DO NOTHING
    RETURNING 1
)
SELECT count(*) AS inserted, pg_notify($9, $2) FROM ins;

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

-- database_identity --
-- What tells this database apart from every other (a route's DSN that reaches the
-- sender's own database is refused): its oid, its server's start time and port.
SELECT d.oid::bigint, pg_postmaster_start_time(), current_setting('port')
FROM pg_database AS d WHERE d.datname = current_database();
