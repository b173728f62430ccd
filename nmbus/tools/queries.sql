-- The SQL of nmbus's tools (nmbus bench and soak, the statistics seed), by name.
--
-- The same format as nmbus/postgres/sql/*.sql, read by the same loader
-- (nmbus.postgres.sql.load) and filled in by the same nmbus.postgres.sql.fill:
-- {schema} is the quoted schema, {queue} the quoted schema-qualified queue
-- table. Every tool works in a schema of its own; the library core never reads
-- this file.

-- drop_schema --
-- Drop a schema a tool owns (bench or soak) with everything in it.
DROP SCHEMA IF EXISTS {schema} CASCADE;

-- ---------------------------------------------------------------------------
-- Benchmarks (nmbus bench). They only touch the bench's own schema.
-- ---------------------------------------------------------------------------

-- bench_preload --
-- Insert $1 rows into subqueue $2 ('I' ready, 'X' processed) with type $3,
-- body {"n": k} (braces doubled for render), unique ids $4 || k, in one statement.
INSERT INTO {queue} (from_endpoint, to_endpoint, subqueue, insert_time, last_processed,
                     retry_time, label, msg_text, unique_id)
SELECT 'bench', 'bench', $2::char(1), now(),
       CASE WHEN $2 = 'X' THEN now() END, now(), $3::text,
       '{{"n":' || g || '}}', $4::text || g
FROM generate_series(1, $1::int) AS g;

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

-- bench_vacuum --
-- Vacuum and analyze a queue table after a bulk load, as autovacuum would (and
-- as it does to a table that has settled: visibility map, statistics).
VACUUM (ANALYZE) {queue};

-- bench_checkpoint --
-- Write out what a bulk load dirtied, so its checkpoint does not land inside
-- the timed part (needs superuser or pg_checkpoint; skipped when not allowed).
CHECKPOINT;

-- bench_ceiling --
-- The bare loop nmbus is measured against: claim up to $1 ready rows with
-- SKIP LOCKED and mark them X, in one autocommitted statement (the ids as an
-- array, as the claim takes them: over segments a generic plan keeps to the
-- primary key).
UPDATE {queue} AS q
SET subqueue = 'X', last_processed = clock_timestamp()
WHERE q.id = ANY (ARRAY(
    SELECT id FROM {queue}
    WHERE subqueue IN ('I', 'R') AND retry_time <= now() AND retry_time < 'infinity'
    ORDER BY priority DESC, retry_time, id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
))
RETURNING q.id, q.from_endpoint, q.insert_time, q.retry_count, q.retry_time,
          q.correlation_id, q.label, q.msg_text, q.msg_headers::text, q.unique_id;

-- bench_single_write_create --
-- The per-batch record of a claim that writes each row once (the single-write
-- ceiling): which rows a batch holds, and the advisory lock its transaction
-- holds while it lives (so a record whose holder is not locked is a crash).
CREATE TABLE {schema}.bench_in_flight (
    batch bigserial PRIMARY KEY,
    holder bigint NOT NULL,
    ids bigint[] NOT NULL
);

-- bench_single_write_claim --
-- The single-write claim, in the batch's own transaction: lock up to $1 ready
-- rows with SKIP LOCKED (a row lock, no new row version) and take the advisory
-- lock $2 that says the holder lives (once: an InitPlan). The same columns as
-- the claim returns; the attempt is counted when the batch finishes.
SELECT q.id, q.from_endpoint, q.insert_time, q.retry_count, q.retry_time,
       q.correlation_id, q.label, q.msg_text, q.msg_headers::text, q.unique_id
FROM {queue} AS q
WHERE q.subqueue IN ('I', 'R') AND q.retry_time <= now() AND q.retry_time < 'infinity'
  AND (SELECT pg_try_advisory_xact_lock($2::bigint))
ORDER BY q.priority DESC, q.retry_time, q.id
LIMIT $1
FOR UPDATE OF q SKIP LOCKED;

-- bench_single_write_record --
-- Before the handlers run, on a connection of its own (committed at once): the
-- batch's record, holder $1, rows $2. Returns its number.
INSERT INTO {schema}.bench_in_flight (holder, ids) VALUES ($1::bigint, $2) RETURNING batch;

-- bench_single_write_finish --
-- The batch's one write of its rows $1, in its own transaction: the attempt
-- counted, X, and its record $2 gone with the same commit.
WITH ended AS (DELETE FROM {schema}.bench_in_flight WHERE batch = $2)
UPDATE {queue} AS q
SET subqueue = 'X', retry_count = q.retry_count + 1, last_processed = clock_timestamp()
WHERE q.id = ANY ($1::bigint[]);

-- bench_single_write_left --
-- The records of batches of the single-write ceiling still there (0 after a run).
SELECT count(*) FROM {schema}.bench_in_flight;

-- bench_attempts --
-- A queue's rows by subqueue and attempts counted, for checks.
SELECT subqueue, retry_count, count(*) AS n FROM {queue} GROUP BY 1, 2 ORDER BY 1, 2;

-- bench_claim_one --
-- The one-message-per-transaction baseline: lock one ready row.
SELECT id, label, msg_text FROM {queue}
WHERE subqueue IN ('I', 'R') AND retry_time <= now() AND retry_time < 'infinity'
ORDER BY priority DESC, retry_time, id
LIMIT 1
FOR UPDATE SKIP LOCKED;

-- bench_mark_one --
-- The one-message-per-transaction baseline: mark row $1 processed.
UPDATE {queue} SET subqueue = 'X', last_processed = clock_timestamp() WHERE id = $1;

-- bench_create_effects --
-- The table the transactional handlers write their effect into.
CREATE TABLE IF NOT EXISTS {schema}.bench_effects (
    message_id bigint NOT NULL,
    n integer NOT NULL
);

-- bench_insert_effect --
-- One handler effect: message $1 with payload $2.
INSERT INTO {schema}.bench_effects (message_id, n) VALUES ($1, $2);

-- bench_count_effects --
-- How many effects were written.
SELECT count(*) FROM {schema}.bench_effects;

-- bench_count_subqueue --
-- Rows of one queue in subqueue $1.
SELECT count(*) FROM {queue} WHERE subqueue = $1;

-- bench_pgqueuer_left --
-- Jobs pgqueuer left in its queue table in the bench's schema (0 after a drain).
SELECT count(*) FROM {schema}.pgqueuer;

-- bench_server --
-- The server's version and the settings that bound the figures.
SELECT version(), current_setting('synchronous_commit'), current_setting('shared_buffers'),
       current_setting('fsync');


-- ---------------------------------------------------------------------------
-- Soak (nmbus soak): the kill soak's own bookkeeping, in its own schema.
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
-- Statistics seed (python -m nmbus.tools.stats_seed): synthetic X and F rows.
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

-- seed_analyze --
-- Refresh the planner's statistics of a queue table after seeding it.
ANALYZE {queue};

-- bench_create_counters --
-- The table the saga bench's hand-written handler counts into, one row per key.
CREATE TABLE IF NOT EXISTS {schema}.bench_counters (k integer PRIMARY KEY, count integer NOT NULL);

-- bench_bump_counter --
-- Count one message for key $1 (the hand-written equivalent of a saga's load and save).
INSERT INTO {schema}.bench_counters AS c (k, count) VALUES ($1, 1)
ON CONFLICT (k) DO UPDATE SET count = c.count + 1;

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

-- bench_preload_aged --
-- Insert $1 X rows processed $2 (interval) ago, of type $3, unique ids $4 || k
-- (bench retention: rows past any max age without an UPDATE of them all).
INSERT INTO {queue} (from_endpoint, to_endpoint, subqueue, insert_time, last_processed,
                     retry_time, label, msg_text, unique_id)
SELECT 'bench', 'bench', 'X', now() - $2::interval - interval '1 second',
       now() - $2::interval, now() - $2::interval - interval '1 second', $3::text,
       '{{"n":' || g || '}}', $4::text || g
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
