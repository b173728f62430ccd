-- Messages processed per UTC day over the last N days (default 7), with
-- average and p99 queue latency (last_processed - retry_time) in ms.
--   psql "$NMBUS_DSN" -v queue=billing -v days=30 -f sql/cookbook/processed_per_day.sql

\if :{?schema}
\else
  \set schema nmbus
\endif
\if :{?queue}
\else
  \warn 'set the queue: psql -v queue=NAME ...'
  \quit
\endif
\if :{?days}
\else
  \set days 7
\endif

SELECT (last_processed AT TIME ZONE 'UTC')::date AS day_utc,
       count(*) AS processed,
       round(avg(extract(epoch FROM last_processed - retry_time) * 1000), 1) AS avg_latency_ms,
       round((percentile_cont(0.99) WITHIN GROUP (
           ORDER BY extract(epoch FROM last_processed - retry_time) * 1000))::numeric, 1)
           AS p99_latency_ms
FROM :"schema".:"queue"
WHERE subqueue = 'X'
  AND (last_processed AT TIME ZONE 'UTC')::date > (now() AT TIME ZONE 'UTC')::date - :days
GROUP BY 1
ORDER BY 1;
