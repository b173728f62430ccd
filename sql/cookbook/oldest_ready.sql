-- How long the oldest ready message has been waiting, and how many wait:
-- rows in I, or in R whose retry_time has come, that no live lease holds
-- (exactly what a worker would claim next). Uses the partial ready index.
--   psql "$NMBUS_DSN" -v queue=billing -f sql/cookbook/oldest_ready.sql
\if :{?schema}
\else
  \set schema nmbus
\endif
\if :{?queue}
\else
  \warn 'set the queue: psql -v queue=NAME ...'
  \quit
\endif

SELECT count(*) AS waiting,
       min(retry_time) AS oldest_ready_since,
       round(extract(epoch FROM now() - min(retry_time))::numeric, 1) AS oldest_age_seconds
FROM :"schema".:"queue"
WHERE subqueue IN ('I', 'R') AND retry_time <= now()
  AND (lease_expires IS NULL OR lease_expires < now());
