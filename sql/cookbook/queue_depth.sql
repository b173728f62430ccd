-- Queue depth per subqueue of one queue, and how many rows a worker holds now.
--   psql "$NMBUS_DSN" -v queue=billing -f sql/cookbook/queue_depth.sql
-- I ready, R scheduled (deferred or waiting for a retry), X processed, F failed.
\if :{?schema}
\else
  \set schema nmbus
\endif
\if :{?queue}
\else
  \warn 'set the queue: psql -v queue=NAME ...'
  \quit
\endif

SELECT s.subqueue,
       count(q.id) AS messages,
       count(q.id) FILTER (WHERE q.handling_client_id IS NOT NULL) AS held_by_worker
FROM (VALUES ('I'), ('R'), ('X'), ('F')) AS s(subqueue)
LEFT JOIN :"schema".:"queue" AS q ON q.subqueue = s.subqueue
GROUP BY s.subqueue
ORDER BY position(s.subqueue IN 'IRXF');
