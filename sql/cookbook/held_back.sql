-- Flow control of one queue (docs/flow-control.md): each handler with limits,
-- as last declared, with its messages in flight now (still leased by the
-- claim that took them), its handler starts in the last second, and the ready
-- messages of its types that no worker holds: while the handler has no room,
-- these are the messages its limits hold back.
--   psql "$NMBUS_DSN" -v queue=payments -f sql/cookbook/held_back.sql
\if :{?schema}
\else
  \set schema nmbus
\endif
\if :{?queue}
\else
  \warn 'set the queue: psql -v queue=NAME ...'
  \quit
\endif

SELECT l.key AS handler,
       l.limits,
       (SELECT count(*)
        FROM :"schema"."flow$flights" AS f
        JOIN :"schema".:"queue" AS q
          ON q.id = f.id AND q.handling_client_id = f.client AND q.retry_count = f.attempt
         AND q.subqueue IN ('I', 'R') AND q.lease_expires > now()
        WHERE f.queue = l.queue AND f.key = l.key) AS in_flight,
       (SELECT count(*)
        FROM :"schema"."flow$flights" AS f
        WHERE f.queue = l.queue AND f.key = l.key
          AND f.started > now() - interval '1 second') AS started_last_second,
       (SELECT count(*)
        FROM :"schema".:"queue" AS q
        WHERE q.label = ANY (l.labels) AND q.subqueue IN ('I', 'R')
          AND q.retry_time <= now() AND q.retry_time < 'infinity'
          AND (q.lease_expires IS NULL OR q.lease_expires < now())) AS ready_waiting
FROM :"schema"."flow$limits" AS l
WHERE l.queue = :'queue'
ORDER BY l.key;
