-- Retention (nmbus/postgres/retention.py): processed and failed rows removed, or
-- archived first, once they are old enough. Like the operations, it touches
-- only F and X rows (and I/R rows that expired long ago), never a row a worker
-- holds.

-- retention_lock --
-- Try to become the one retention run of a queue (session advisory lock). $1: lock key text.
SELECT pg_try_advisory_lock(hashtext($1));

-- retention_unlock --
-- Give up the retention lock taken by retention_lock. $1: lock key text.
SELECT pg_advisory_unlock(hashtext($1));

-- retention_lock_held --
-- Behind a transaction pooler, where no session outlives a transaction: become
-- the one retention run of a queue until this transaction ends, the lock
-- retention_lock takes (a session's and a transaction's lock on one key exclude
-- each other). The transaction stays open for the whole run, idle while the run
-- works on another connection: a server's idle_in_transaction_session_timeout
-- would end it, and the lock with it, so it is lifted for this transaction.
-- $1: lock key text.
SELECT set_config('idle_in_transaction_session_timeout', '0', true),
       pg_try_advisory_xact_lock(hashtext($1));

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

-- retention_next_id --
-- The lowest id above $1 (a probe of the primary key), or NULL.
SELECT min(id) FROM {queue} WHERE id > $1;

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
