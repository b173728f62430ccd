-- Move every failed message of one queue back to I, and wake the workers.
--   psql "$NMBUS_DSN" -v queue=billing -f sql/cookbook/requeue_all.sql
-- Optionally only one message type: add -v type=billing.ChargeCard
-- Same reset as requeue_one.sql. For very many rows prefer
-- nmbus failed requeue billing --all, which works in batches.

\if :{?schema}
\else
  \set schema nmbus
\endif
\if :{?queue}
\else
  \warn 'set the queue: psql -v queue=NAME ...'
  \quit
\endif
\if :{?type}
\else
  \set type ''
\endif

WITH moved AS (
    UPDATE :"schema".:"queue"
    SET subqueue = 'I', retry_count = 0, retry_time = now(),
        handling_client_id = NULL, lease_expires = NULL
    WHERE subqueue = 'F' AND (:'type' = '' OR label = :'type')
    RETURNING id
)
SELECT count(*) AS requeued,
       count(*) > 0 AND pg_notify('nmbus_' || :'schema', :'queue') IS NOT NULL AS notified
FROM moved;
