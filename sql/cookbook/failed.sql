-- The failed messages of one queue with their errors, oldest first.
--   psql "$NMBUS_DSN" -v queue=billing -f sql/cookbook/failed.sql
-- error is the first line of error_info ("Type: message"); the traceback
-- follows it there: SELECT error_info FROM nmbus."billing" WHERE id = 42;
\if :{?schema}
\else
  \set schema nmbus
\endif
\if :{?queue}
\else
  \warn 'set the queue: psql -v queue=NAME ...'
  \quit
\endif

SELECT id, label AS message_type, retry_count AS attempts, insert_time, last_processed AS failed_at,
       split_part(coalesce(error_info, ''), E'\n', 1) AS error
FROM :"schema".:"queue"
WHERE subqueue = 'F'
ORDER BY id;
