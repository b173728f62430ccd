-- The ready backlog of one queue as one integer, for an autoscaler (KEDA's
-- PostgreSQL scaler: docs/deployment.md): the messages its workers could start
-- now. A ready message (I, or R whose retry_time has come, that no live lease
-- holds, the head of its sequence if it is in one: exactly what a claim takes)
-- counts once if no handler with flow limits handles its type. Those of a
-- handler with limits (docs/flow-control.md; a type chain counts, as in the
-- claim) count up to the room its limits leave now: what `concurrency` leaves
-- beside its messages in flight, what `rate` leaves in its window, and per
-- group what `group_concurrency` leaves. More workers could not start the rest
-- (held back by the limits, shared by every process), so it does not count. A
-- message two limited handlers handle counts under each. Messages a worker
-- holds are not counted: they are being handled. Reads every segment of the
-- queue table (the ready index of each) and the flow tables; read-only.
--   psql "$NMBUS_DSN" -X -At -v queue=billing -f sql/cookbook/ready_backlog.sql
\if :{?schema}
\else
  \set schema nmbus
\endif
\if :{?queue}
\else
  \warn 'set the queue: psql -v queue=NAME ...'
  \quit
\endif

WITH ready AS (
    SELECT r.label, string_to_array(r.msg_headers ->> 'nmbus-type-chain', ',') AS chain,
           coalesce(r.msg_headers ->> 'nmbus-group', '') AS group_key
    FROM :"schema".:"queue" AS r
    WHERE r.subqueue IN ('I', 'R') AND r.retry_time <= now() AND r.retry_time < 'infinity'
      AND (r.lease_expires IS NULL OR r.lease_expires < now())
      AND (r.sequence_key IS NULL OR r.id = (
          SELECT e.id FROM :"schema".:"queue" AS e
          WHERE e.sequence_key = r.sequence_key AND e.subqueue <> 'X'
          ORDER BY e.sequence_key, e.id LIMIT 1))
), lim AS (
    SELECT l.key, l.labels, l.concurrency, l.starts, l.window_s, l.group_concurrency
    FROM :"schema"."flow$limits" AS l
    WHERE l.queue = :'queue'
), flown AS (
    SELECT f.key, f.group_key, f.started,
           EXISTS (SELECT 1 FROM :"schema".:"queue" AS q
                   WHERE q.id = f.id AND q.handling_client_id = f.client
                     AND q.retry_count = f.attempt AND q.subqueue IN ('I', 'R')
                     AND q.lease_expires > now()) AS running
    FROM :"schema"."flow$flights" AS f
    WHERE f.queue = :'queue'
), room AS (
    SELECT l.key, l.group_concurrency,
           -- NULL: neither limit is set (least and greatest pass over a NULL).
           CASE WHEN l.concurrency IS NOT NULL OR l.starts IS NOT NULL THEN greatest(0, least(
               l.concurrency - (SELECT count(*) FROM flown AS f
                                WHERE f.key = l.key AND f.running),
               l.starts - (SELECT count(*) FROM flown AS f
                           WHERE f.key = l.key
                             AND ((f.started IS NULL AND f.running)
                                  OR f.started > now() - make_interval(secs => l.window_s)))
           )) END AS free
    FROM lim AS l
), matched AS (
    SELECT l.key, r.group_key, count(*) AS waiting
    FROM lim AS l
    JOIN ready AS r ON r.label = ANY (l.labels) OR coalesce(r.chain && l.labels, false)
    GROUP BY l.key, r.group_key
), startable AS (
    SELECT m.key,
           sum(CASE WHEN m.group_key = '' OR rm.group_concurrency IS NULL THEN m.waiting
                    ELSE least(m.waiting, greatest(0, rm.group_concurrency - (
                        SELECT count(*) FROM flown AS f
                        WHERE f.key = m.key AND f.group_key = m.group_key AND f.running)))
               END) AS n
    FROM matched AS m
    JOIN room AS rm ON rm.key = m.key
    GROUP BY m.key
)
SELECT ((SELECT count(*) FROM ready AS r
         WHERE NOT EXISTS (SELECT 1 FROM lim AS l
                           WHERE r.label = ANY (l.labels)
                              OR coalesce(r.chain && l.labels, false)))
        + coalesce((SELECT sum(least(s.n, coalesce(rm.free, s.n)))
                    FROM startable AS s JOIN room AS rm ON rm.key = s.key), 0))::bigint
       AS ready_backlog;
