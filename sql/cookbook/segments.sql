-- The segments of one queue: the partitions of its table (found through
-- pg_inherits), oldest first, each with its id bounds (NULL: MINVALUE or
-- MAXVALUE), its rows as PostgreSQL estimates them (no count), the
-- insert_time of its lowest and highest id (one probe of the primary key
-- each, in that segment alone) and its size with indexes and TOAST. A queue
-- table that is not partitioned is one segment, the table itself.
--   psql "$NMBUS_DSN" -v queue=billing -f sql/cookbook/segments.sql
\if :{?schema}
\else
  \set schema nmbus
\endif
\if :{?queue}
\else
  \warn 'set the queue: psql -v queue=NAME ...'
  \quit
\endif

WITH t AS (
    SELECT c.oid, c.relkind
    FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
    WHERE n.nspname = :'schema' AND c.relname = :'queue' AND c.relkind IN ('r', 'p')
), s AS (
    SELECT p.oid, p.relname AS segment, pg_get_expr(p.relpartbound, p.oid) AS bound
    FROM t
    JOIN pg_inherits AS i ON i.inhparent = t.oid
    JOIN pg_class AS p ON p.oid = i.inhrelid
    WHERE t.relkind = 'p'
    UNION ALL
    SELECT t.oid, :'queue', NULL FROM t WHERE t.relkind = 'r'
), b AS (
    SELECT s.oid, s.segment,
           (regexp_match(s.bound, 'FROM \(''?(-?[0-9]+)''?\)'))[1]::bigint AS low_id,
           (regexp_match(s.bound, 'TO \(''?(-?[0-9]+)''?\)'))[1]::bigint AS high_id
    FROM s
)
SELECT b.segment, b.low_id, b.high_id,
       greatest(coalesce(st.n_live_tup, 0), c.reltuples::bigint, 0) AS rows_estimate,
       (SELECT q.insert_time FROM :"schema".:"queue" AS q
        WHERE q.id >= coalesce(b.low_id, -9223372036854775808)
          AND q.id <= coalesce(b.high_id - 1, 9223372036854775807)
        ORDER BY q.id LIMIT 1) AS oldest_insert_time,
       (SELECT q.insert_time FROM :"schema".:"queue" AS q
        WHERE q.id >= coalesce(b.low_id, -9223372036854775808)
          AND q.id <= coalesce(b.high_id - 1, 9223372036854775807)
        ORDER BY q.id DESC LIMIT 1) AS newest_insert_time,
       pg_size_pretty(pg_total_relation_size(b.oid)) AS size
FROM b
JOIN pg_class AS c ON c.oid = b.oid
LEFT JOIN pg_stat_user_tables AS st ON st.relid = b.oid
ORDER BY b.low_id NULLS FIRST, b.segment;
