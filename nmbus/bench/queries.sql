-- The SQL of nmbus bench (its modes and the scratch schema they run in), by name.
--
-- The same format as nmbus/postgres/sql/*.sql, read by the same loader
-- (nmbus.postgres.sql.load) and filled in by the same nmbus.postgres.sql.fill:
-- {schema} is the quoted schema, {queue} the quoted schema-qualified queue
-- table. Every benchmark works in a schema of its own; the library core never
-- reads this file. The repository's bench/ uses these blocks too (the scratch
-- schema, its pre-loads); its own are in bench/queries.sql.

-- drop_schema --
-- Drop a schema a benchmark or the soak owns, with everything in it.
DROP SCHEMA IF EXISTS {schema} CASCADE;

-- ---------------------------------------------------------------------------
-- The scratch schema: its rows pre-loaded, vacuumed, counted.
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

-- bench_vacuum --
-- Vacuum and analyze a queue table after a bulk load, as autovacuum would (and
-- as it does to a table that has settled: visibility map, statistics).
VACUUM (ANALYZE) {queue};

-- bench_checkpoint --
-- Write out what a bulk load dirtied, so its checkpoint does not land inside
-- the timed part (needs superuser or pg_checkpoint; skipped when not allowed).
CHECKPOINT;

-- bench_count_subqueue --
-- Rows of one queue in subqueue $1.
SELECT count(*) FROM {queue} WHERE subqueue = $1;

-- bench_preload_aged --
-- Insert $1 X rows processed $2 (interval) ago, of type $3, unique ids $4 || k
-- (bench retention: rows past any max age without an UPDATE of them all).
INSERT INTO {queue} (from_endpoint, to_endpoint, subqueue, insert_time, last_processed,
                     retry_time, label, msg_text, unique_id)
SELECT 'bench', 'bench', 'X', now() - $2::interval - interval '1 second',
       now() - $2::interval, now() - $2::interval - interval '1 second', $3::text,
       '{{"n":' || g || '}}', $4::text || g
FROM generate_series(1, $1::int) AS g;

-- ---------------------------------------------------------------------------
-- ceiling and transactional: the bare loops nmbus is measured against.
-- ---------------------------------------------------------------------------

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

-- ---------------------------------------------------------------------------
-- saga: the queue analyzed once stored, and the hand-written table it is compared with.
-- ---------------------------------------------------------------------------

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

-- ---------------------------------------------------------------------------
-- Every mode: the server's settings, printed with the figures.
-- ---------------------------------------------------------------------------

-- bench_server --
-- The server's version and the settings that bound the figures.
SELECT version(), current_setting('synchronous_commit'), current_setting('shared_buffers'),
       current_setting('fsync');
