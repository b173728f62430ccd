-- Move one failed message back to I as a fresh message, and wake the workers.
--   psql "$NMBUS_DSN" -v queue=billing -v id=42 -f sql/cookbook/requeue_one.sql
-- Resets what a fresh attempt needs: retry_count 0 (attempts start over),
-- retry_time now() (ready now, and latency counts from now), no lease.
-- error_info is kept until the next attempt overwrites it. NOTIFY uses the
-- channel the workers listen on (nmbus_<schema>) with the queue as payload.

\if :{?schema}
\else
  \set schema nmbus
\endif
\if :{?queue}
\else
  \warn 'set the queue: psql -v queue=NAME ...'
  \quit
\endif
\if :{?id}
\else
  \warn 'set the message: psql -v id=N ...'
  \quit
\endif

WITH moved AS (
    UPDATE :"schema".:"queue"
    SET subqueue = 'I', retry_count = 0, retry_time = now(),
        handling_client_id = NULL, lease_expires = NULL
    WHERE id = :id AND subqueue = 'F'
    RETURNING id
)
SELECT count(*) AS requeued,
       count(*) > 0 AND pg_notify('nmbus_' || :'schema', :'queue') IS NOT NULL AS notified
FROM moved;
