-- The SQL of the repository's bench/ (peers, soak, scenario tools), by name.
--
-- The same format as nmbus/postgres/sql/*.sql, read by the same loader
-- (nmbus.postgres.sql.load): bench/sql.py. The scratch schema's blocks
-- (drop_schema, bench_preload, bench_vacuum, ...) are nmbus bench's, in
-- nmbus/bench/queries.sql. None of this is in the wheel.

-- ---------------------------------------------------------------------------
-- Scenario modes of python -m bench: flow, delivery, retention, peers.
-- ---------------------------------------------------------------------------

-- bench_flow_marks --
-- When the handlers of queue $1's rate-limited messages started, as marked.
SELECT started FROM {schema}."flow$flights" WHERE queue = $1 AND started IS NOT NULL;

-- bench_preload_grouped --
-- Insert $1 ready rows of type $2 in group $4 (header $3, the group header), or
-- each in a group of its own ('group-' || k) when $4 is NULL; unique ids
-- $5 || k.
INSERT INTO {queue} (from_endpoint, to_endpoint, subqueue, insert_time, retry_time, label,
                     msg_text, msg_headers, unique_id)
SELECT 'bench', 'bench', 'I', now(), now(), $2::text, '{{"n":' || g || '}}',
       jsonb_build_object($3::text, coalesce($4::text, 'group-' || g)), $5::text || g
FROM generate_series(1, $1::int) AS g;

-- bench_preload_delivery --
-- Insert $1 ready rows of type $2 with unique ids $3 || k; priority k*7 mod $4
-- (0..$4-1; $4 = 1: all 0) and, when $5 > 0, sequence 'seq-' || (k mod $5), so the
-- members of the $5 sequences are interleaved, each in id order; all but the first
-- member of each are parked, as insert_messages would.
INSERT INTO {queue} (from_endpoint, to_endpoint, subqueue, insert_time, retry_time, label,
                     msg_text, unique_id, priority, sequence_key)
SELECT 'bench', 'bench', 'I', now(),
       CASE WHEN $5::int > 0 AND g > $5::int THEN 'infinity'::timestamptz ELSE now() END,
       $2::text, '{{"n":' || g || '}}', $3::text || g,
       ((g * 7) % $4::int)::smallint,
       CASE WHEN $5::int > 0 THEN 'seq-' || (g % $5::int) END
FROM generate_series(1, $1::int) AS g;

-- bench_vacuum_only --
-- VACUUM the queue (every segment) and its unique table, as must follow a DELETE.
VACUUM {queue}, {unique_table};

-- bench_retention_state --
-- The queue's size on disk (segments and unique table, with indexes), the dead
-- tuples the statistics system counts in them, and the WAL position (bytes).
-- $1: the queue table, $2: its unique table (quoted, schema-qualified names).
SELECT (SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree($1::regclass))
           + pg_total_relation_size($2::regclass) AS bytes,
       (SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables
        WHERE relid IN (SELECT relid FROM pg_partition_tree($1::regclass))
           OR relid = $2::regclass) AS dead,
       pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0') AS lsn;

-- bench_pgqueuer_left --
-- Jobs pgqueuer left in its queue table in the bench's schema (0 after a drain).
SELECT count(*) FROM {schema}.pgqueuer;

-- ---------------------------------------------------------------------------
-- Soak (python -m bench.soak): the kill soak's own bookkeeping, in its own schema.
-- ---------------------------------------------------------------------------

-- soak_create_effects --
-- The table soak handlers write through ctx.connection: one row per committed handling.
CREATE TABLE IF NOT EXISTS {schema}.soak_effects (
    unique_id text NOT NULL,
    attempt integer NOT NULL,
    pid integer NOT NULL
);

-- soak_record_effect --
-- A soak handler's transactional effect. $1 unique_id, $2 attempt, $3 worker pid.
INSERT INTO {schema}.soak_effects (unique_id, attempt, pid) VALUES ($1, $2, $3);

-- soak_open_rows --
-- Rows of the soak queue not yet in X or F.
SELECT count(*) FROM {queue} WHERE subqueue IN ('I', 'R');

-- soak_rows --
-- Every row of the soak queue with its committed effects (unique_id, subqueue,
-- retry_count, error_info's first line, effects as (attempt, pid) pairs).
SELECT q.unique_id, q.subqueue, q.retry_count, split_part(q.error_info, E'\n', 1),
       coalesce(array_agg(e.attempt ORDER BY e.attempt) FILTER (WHERE e.attempt IS NOT NULL),
                ARRAY[]::integer[]),
       coalesce(array_agg(e.pid ORDER BY e.attempt) FILTER (WHERE e.pid IS NOT NULL),
                ARRAY[]::integer[])
FROM {queue} AS q
LEFT JOIN {schema}.soak_effects AS e ON e.unique_id = q.unique_id
GROUP BY q.unique_id, q.subqueue, q.retry_count, q.error_info;

-- ---------------------------------------------------------------------------
-- Statistics seed (python -m bench.stats_seed): synthetic X and F rows.
-- ---------------------------------------------------------------------------

-- seed_rows --
-- Rows g = $1..$2 of $3 in total, into one queue: inserted from $4 over $5 seconds, a
-- failure share $6, a latency spike if $7 = 1, to_endpoint $8, unique ids $9 || g,
-- error lines $10, labels $11.
INSERT INTO {queue} (from_endpoint, to_endpoint, subqueue, insert_time, last_processed,
                     retry_count, retry_time, error_info, correlation_id, label,
                     msg_text, msg_headers, unique_id)
SELECT 'seed', $8, CASE WHEN failed THEN 'F' ELSE 'X' END, ins,
       ready + lat, attempts, ready,
       CASE WHEN failed OR attempts > 1
            THEN ($10::text[])[1 + ((g / 5) % 4)::int]
                 || E'\nTraceback (most recent call last):\n'
                 || '  File "handlers.py", line 42, in handle\n'
            END,
       'c' || (g / 3), ($11::text[])[1 + ((g * 7) % 4)::int],
       '{{"n": ' || g || '}}', '{{}}'::jsonb, $9 || g
FROM (
    SELECT g, failed, attempts, ins,
           ins + (attempts - 1) * interval '2 seconds'
               + exp(random() * 6) * interval '1 millisecond' AS ready,
           exp(random() * 7 + 1) * interval '50 microseconds'
               * CASE WHEN $7::int = 1 AND g BETWEEN $3 * 0.55 AND $3 * 0.62
                      THEN 25 ELSE 1 END AS lat
    FROM (
        SELECT g, r < $6::float8 AS failed,
               CASE WHEN r < $6 THEN 5 WHEN r < $6 * 4 THEN 2 + (g % 3)::int ELSE 1 END
                   AS attempts,
               $4::timestamptz
                   + ($5::float8 * (g - 1)::float8 / $3::bigint) * interval '1 second' AS ins
        FROM (SELECT g, random() AS r FROM generate_series($1::bigint, $2::bigint) AS g) AS a
    ) AS b
) AS c;

-- ---------------------------------------------------------------------------
-- Dashboard benchmark (python -m bench.dashboard).
-- ---------------------------------------------------------------------------

-- dashbench_seed_x --
-- $1 processed rows spread evenly over the last 7 days, oldest first, with queue latencies of 3-99 ms (the dashboard benchmark).
INSERT INTO {queue} (from_endpoint, to_endpoint, subqueue, insert_time, last_processed,
                     retry_count, retry_time, label, msg_text, msg_headers)
SELECT 'shop', 'orders', 'X', t - interval '20 ms', t, 1, t - ((g % 97) + 3) * interval '1 ms',
       'orders.Placed', jsonb_build_object('order_id', g)::text,
       jsonb_build_object('tenant', 'acme')
FROM generate_series(1, $1::bigint) AS g,
     LATERAL (SELECT now() - ($1::bigint - g) * (interval '7 days' / $1::bigint) AS t) AS s;

-- dashbench_seed_open --
-- $1 ready rows (I, oldest 10 minutes ago), $2 scheduled rows (R, due in an hour) and $3 failed rows over the last day.
INSERT INTO {queue} (from_endpoint, to_endpoint, subqueue, last_processed, retry_count,
                     retry_time, label, msg_text, error_info)
SELECT 'shop', 'orders', 'I', NULL::timestamptz, 0, now() - g * interval '1 s' * 600 / $1::int,
       'orders.Placed', jsonb_build_object()::text, NULL::text
FROM generate_series(1, $1::int) AS g
UNION ALL
SELECT 'shop', 'orders', 'R', NULL, 1, now() + interval '1 hour', 'orders.Placed',
       jsonb_build_object()::text, NULL
FROM generate_series(1, $2::int) AS g
UNION ALL
SELECT 'shop', 'orders', 'F', now() - g * interval '1 day' / $3::int, 5,
       now() - g * interval '1 day' / $3::int, 'orders.Placed', jsonb_build_object()::text,
       CASE WHEN g % 3 = 0 THEN 'KeyError: sku' ELSE 'ValueError: card declined' END
FROM generate_series(1, $3::int) AS g;

-- bench_count_all --
-- Every row of a queue, counted one by one (a full scan: the dashboard benchmark's ceiling).
SELECT count(*) FROM {queue};

-- dashbench_drop_done_index --
-- The queue as it was before schema version 7, for measuring what the done index costs a drain.
DROP INDEX {schema}.{done_index};

-- dashbench_many_seed --
-- A small queue of the many-queues benchmark: $1 processed rows over the last hour, $2 ready rows (oldest $2 minutes ago), $3 failed rows.
INSERT INTO {queue} (from_endpoint, to_endpoint, subqueue, last_processed, retry_count,
                     retry_time, label, msg_text, error_info)
SELECT 'shop', 'orders', 'X', now() - g * interval '1 hour' / ($1::int + 1), 1,
       now() - g * interval '1 hour' / ($1::int + 1) - interval '20 ms', 'orders.Placed',
       jsonb_build_object('order_id', g)::text, NULL::text
FROM generate_series(1, $1::int) AS g
UNION ALL
SELECT 'shop', 'orders', 'I', NULL, 0, now() - g * interval '1 minute', 'orders.Placed',
       jsonb_build_object()::text, NULL
FROM generate_series(1, $2::int) AS g
UNION ALL
SELECT 'shop', 'orders', 'F', now() - g * interval '1 minute', 5, now(), 'orders.Placed',
       jsonb_build_object()::text, 'ValueError: card declined'
FROM generate_series(1, $3::int) AS g;

-- dashbench_analyze --
-- Statistics of every table of the many-queues benchmark's schema, as autovacuum leaves them.
ANALYZE;
