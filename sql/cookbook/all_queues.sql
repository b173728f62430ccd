-- Depth of every queue in one statement (each queue is its own table, so the
-- per-queue count runs through query_to_xml with the table name quoted by %I).
--   psql "$NMBUS_DSN" -f sql/cookbook/all_queues.sql
\if :{?schema}
\else
  \set schema nmbus
\endif

WITH live AS MATERIALIZED (
    SELECT name FROM :"schema".queues
    WHERE to_regclass(format('%I.%I', :'schema', name)) IS NOT NULL
), counted AS (
    SELECT name,
           query_to_xml(format(
               'SELECT count(*) FILTER (WHERE subqueue = ''I'') AS i,
                       count(*) FILTER (WHERE subqueue = ''R'') AS r,
                       count(*) FILTER (WHERE subqueue = ''X'') AS x,
                       count(*) FILTER (WHERE subqueue = ''F'') AS f
                FROM %I.%I', :'schema', name), false, true, '') AS doc
    FROM live
)
SELECT name AS queue,
       (xpath('/row/i/text()', doc))[1]::text::bigint AS ready,
       (xpath('/row/r/text()', doc))[1]::text::bigint AS scheduled,
       (xpath('/row/x/text()', doc))[1]::text::bigint AS processed,
       (xpath('/row/f/text()', doc))[1]::text::bigint AS failed
FROM counted
ORDER BY name;
