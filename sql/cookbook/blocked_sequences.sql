-- Ordered sequences of one queue held back by their head, the lowest member not
-- yet in X (docs/delivery.md): a head in F blocks its sequence until an operator
-- requeues it (requeue_one.sql with -v id=<blocking_id>) or purges it; a head in R
-- holds it until its retry succeeds.
--   psql "$NMBUS_DSN" -v queue=ledger -f sql/cookbook/blocked_sequences.sql
\if :{?schema}
\else
  \set schema nmbus
\endif
\if :{?queue}
\else
  \warn 'set the queue: psql -v queue=NAME ...'
  \quit
\endif

SELECT h.sequence_key, h.id AS blocking_id, h.subqueue, h.retry_count AS attempts,
       h.retry_time,
       (SELECT count(*) FROM :"schema".:"queue" AS w
        WHERE w.sequence_key = h.sequence_key AND w.id > h.id AND w.subqueue <> 'X') AS waiting,
       split_part(coalesce(h.error_info, ''), E'\n', 1) AS error
FROM (
    SELECT DISTINCT ON (sequence_key) sequence_key, id, subqueue, retry_count, retry_time,
           error_info
    FROM :"schema".:"queue"
    WHERE sequence_key IS NOT NULL AND subqueue <> 'X'
    ORDER BY sequence_key, id
) AS h
WHERE h.subqueue = 'F' OR (h.subqueue = 'R' AND h.retry_time > now())
ORDER BY h.subqueue = 'F' DESC, h.id;
