-- Messages a worker holds that have been ready for more than N minutes
-- (default 5). The bus does not record the moment of the claim; a held row
-- was claimed at or after retry_time, so ready_for is an upper bound on how
-- long it has been held. lease_lapsed = true: the holder stopped renewing its
-- lease (it died or hangs); the row will be claimed again by another worker.
--   psql "$NMBUS_DSN" -v queue=billing -v minutes=15 -f sql/cookbook/held_too_long.sql

\if :{?schema}
\else
  \set schema nmbus
\endif
\if :{?queue}
\else
  \warn 'set the queue: psql -v queue=NAME ...'
  \quit
\endif
\if :{?minutes}
\else
  \set minutes 5
\endif

SELECT id, label AS message_type, handling_client_id AS held_by, retry_count AS attempts,
       round(extract(epoch FROM now() - retry_time)::numeric / 60, 1) AS ready_for_minutes,
       lease_expires,
       lease_expires < now() AS lease_lapsed
FROM :"schema".:"queue"
WHERE subqueue IN ('I', 'R') AND handling_client_id IS NOT NULL
  AND retry_time < now() - make_interval(mins => :minutes)
ORDER BY retry_time, id;
