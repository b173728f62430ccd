-- Average and p99 queue latency (ms) of the messages processed in the last 10
-- minutes: the time between a message being ready (retry_time) and being done
-- (last_processed). Change the window with -v minutes=60.
--   psql "$NMBUS_DSN" -v queue=billing -f sql/cookbook/latency.sql

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
  \set minutes 10
\endif

SELECT count(*) AS processed,
       round(avg(extract(epoch FROM last_processed - retry_time) * 1000), 1) AS avg_ms,
       round((percentile_cont(0.99) WITHIN GROUP (
           ORDER BY extract(epoch FROM last_processed - retry_time) * 1000))::numeric, 1)
           AS p99_ms,
       round(max(extract(epoch FROM last_processed - retry_time) * 1000), 1) AS max_ms
FROM :"schema".:"queue"
WHERE subqueue = 'X' AND last_processed > now() - make_interval(mins => :minutes);
