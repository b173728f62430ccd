-- Operations: status, failed messages, subscriptions (run by
-- nmbus/postgres/operations.py and status.py for nmbus.ops.admin, the nmbus
-- commands and the dashboard). Readers never take more than ROW EXCLUSIVE
-- on a queue; writers touch only F or X rows, which no worker claims.

-- ops_queue_status --
-- One pass over a queue: rows per subqueue, rows held by a worker (leased), age in seconds of the oldest row waiting to be claimed, average/p99 latency (ms) and count of rows processed in the last $1 seconds.
SELECT count(*) FILTER (WHERE subqueue = 'I') AS ready,
       count(*) FILTER (WHERE subqueue = 'R') AS scheduled,
       count(*) FILTER (WHERE subqueue = 'X') AS processed,
       count(*) FILTER (WHERE subqueue = 'F') AS failed,
       count(*) FILTER (WHERE subqueue IN ('I', 'R')
                        AND handling_client_id IS NOT NULL)
           AS in_flight,
       extract(epoch FROM now() - min(retry_time)
           FILTER (WHERE subqueue IN ('I', 'R') AND retry_time <= now()
                   AND (lease_expires IS NULL OR lease_expires < now())))::float8
           AS oldest_ready_seconds,
       count(*) FILTER (WHERE subqueue = 'X'
           AND last_processed > now() - make_interval(secs => $1)) AS recent_processed,
       (avg(extract(epoch FROM last_processed - retry_time) * 1000)
           FILTER (WHERE subqueue = 'X' AND last_processed > now() - make_interval(secs => $1))
       )::float8 AS recent_avg_ms,
       (percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM last_processed - retry_time) * 1000)
           FILTER (WHERE subqueue = 'X' AND last_processed > now() - make_interval(secs => $1))
       )::float8 AS recent_p99_ms,
       count(*) FILTER (WHERE subqueue = 'F' AND last_processed > now() - make_interval(secs => $1))
           AS recent_failed
FROM {queue} AS q;

-- ops_outbox_status --
-- The outbox's backlog per destination queue: rows waiting, the age in seconds
-- of the oldest (the forwarding lag), and when it was written.
SELECT to_endpoint AS queue, count(*) AS waiting,
       extract(epoch FROM now() - min(insert_time))::float8 AS oldest_seconds
FROM {schema}.outbox
GROUP BY to_endpoint
ORDER BY to_endpoint;

-- ops_queue_counts --
-- The cheap figures of a queue, never a scan of its X rows. $1: schema, $2: queue name (both unquoted). I and R rows are read through the ready index (and the sequence index for members parked at retry_time 'infinity'), so their cost follows the backlog; F rows through the done index. live_rows is the statistics system's count of live rows (pg_stat_user_tables.n_live_tup, kept up to date by every insert and delete, not by a scan) and pages the table's current size, from which X is estimated.
{ops_open_counts},
       (SELECT array[t.live_rows, t.pages]
        FROM to_regclass(format('%I.%I', $1::text, $2::text)) AS r,
             LATERAL ({tree_size(table => r)}) AS t) AS tree
FROM open;

-- tree_size --
-- Fragment of ops_queue_counts, ops_queue_sizes and ops_table_rows: the live rows
-- (pg_stat_user_tables.n_live_tup) and pages of table {:table} with every segment
-- of it (pg_partition_tree; a plain table is its own tree).
SELECT coalesce(sum(s.n_live_tup), 0)::bigint AS live_rows,
       (coalesce(sum(pg_relation_size(p.relid)), 0)
        / current_setting('block_size')::bigint)::bigint AS pages
FROM pg_partition_tree({:table}) AS p
LEFT JOIN pg_stat_user_tables AS s ON s.relid = p.relid

-- ops_open_counts --
-- Fragment of ops_queue_counts and ops_queue_depth, which add columns to it:
-- the CTE `open`, every I and R row (through the ready index, and the sequence
-- index for members parked at retry_time 'infinity'), and what they count of
-- it, with the F rows (through the done index). In flight: leased.
WITH open AS (
    SELECT id, subqueue, handling_client_id, retry_time, lease_expires
    FROM {queue} WHERE subqueue IN ('I', 'R') AND retry_time < 'infinity'
    UNION ALL
    SELECT id, subqueue, handling_client_id, retry_time, lease_expires
    FROM {queue}
    WHERE sequence_key IS NOT NULL AND subqueue <> 'X' AND retry_time = 'infinity'
      AND subqueue IN ('I', 'R')
)
SELECT count(*) FILTER (WHERE subqueue = 'I') AS ready,
       count(*) FILTER (WHERE subqueue = 'R') AS scheduled,
       count(*) FILTER (WHERE handling_client_id IS NOT NULL)
           AS in_flight,
       extract(epoch FROM now() - min(retry_time)
           FILTER (WHERE retry_time <= now()
                   AND (lease_expires IS NULL OR lease_expires < now())))::float8
           AS oldest_ready_seconds,
       (SELECT count(*) FROM {queue} WHERE subqueue = 'F') AS failed

-- ops_queue_sizes --
-- Every registered queue that has a table, by name: the statistics system's live-row count (as in ops_queue_counts), its size in pages and its table's comment (the mark of a queue a send created, see mark_created_by_send). $1: schema (unquoted).
SELECT q.name, t.live_rows, t.pages, obj_description(c.oid, 'pg_class') AS note
FROM {schema}.queues AS q
JOIN pg_namespace AS n ON n.nspname = $1
JOIN pg_class AS c ON c.relnamespace = n.oid AND c.relname = q.name AND c.relkind IN ('r', 'p'),
LATERAL ({tree_size(table => c.oid)}) AS t
ORDER BY q.name;

-- ops_marked_queues --
-- Every table of the schema whose comment is $2 (the mark of a queue a send created, see mark_created_by_send), in one read of the catalogue whatever the number of queues. $1: schema (unquoted).
SELECT c.relname AS name
FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') AND obj_description(c.oid, 'pg_class') = $2;

-- ops_first_sender --
-- The endpoint that sent a queue's oldest message (for a queue a send created: that send, unless retention removed it); no row when the table is empty.
SELECT from_endpoint AS sender FROM {queue} ORDER BY id LIMIT 1;

-- ops_queue_depth --
-- One queue's depths, as ops_queue_counts reads them but without the statistics (see ops_queue_sizes), and how many sequences are blocked (at most $1). Admin.queue_depths reads many queues in one statement: a UNION ALL of this block, one per queue, each under its position in the list.
{ops_open_counts},
       (SELECT count(*) FROM (
            SELECT 1 FROM (
                SELECT DISTINCT ON (sequence_key) id, subqueue, retry_time
                FROM {queue}
                WHERE sequence_key IS NOT NULL AND subqueue <> 'X'
                ORDER BY sequence_key, id
            ) AS h
            WHERE h.subqueue = 'F' OR (h.subqueue = 'R' AND h.retry_time > now())
            LIMIT $1) AS b) AS blocked
FROM open;

-- ops_rows_estimate --
-- Rows of the given queue tables together, estimated without a scan: per table the larger of the statistics system's live rows (pg_stat_user_tables.n_live_tup: current on a primary, but zero after a crash, a stats reset, or on a standby) and the planner's row count (pg_class.reltuples: as of the last vacuum or analyze, replicated, -1 before the first). The larger one errs towards a big run. $1: schema, $2: queue names (both unquoted).
-- A segmented table counts as its segments together.
SELECT coalesce(sum(greatest(coalesce(s.n_live_tup, 0), l.reltuples::bigint, 0)), 0)::bigint
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
CROSS JOIN LATERAL pg_partition_tree(c.oid) AS p
JOIN pg_class l ON l.oid = p.relid AND p.isleaf
LEFT JOIN pg_stat_user_tables s ON s.relid = l.oid
WHERE n.nspname = $1 AND c.relname = ANY($2::text[]) AND c.relkind IN ('r', 'p');

-- ops_count_processed --
-- How many X rows a queue holds, exactly: a walk of the X part of the done index (for small tables only; see ops_queue_counts).
SELECT count(*) FROM {queue} WHERE subqueue = 'X';

-- ops_window --
-- The last $1 seconds of a queue, read through the done index, newest first and at most $2 rows of X: how many rows went to X, the oldest last_processed among them (where the read stopped, when it reached $2), their queue latency (last_processed - retry_time) average and p50/p95/p99 in ms, and how many went to F (at most $2) over the same span: the whole window, or only since that oldest X row when the read stopped there, so a failure rate compares like with like.
WITH x AS (
    SELECT last_processed, extract(epoch FROM last_processed - retry_time) * 1000 AS ms
    FROM {queue}
    WHERE subqueue = 'X' AND last_processed > now() - make_interval(secs => $1::float8)
    ORDER BY last_processed DESC
    LIMIT $2
), s AS (
    SELECT count(*) AS processed,
           min(last_processed) AS since,
           avg(ms)::float8 AS avg_ms,
           (percentile_cont(0.50) WITHIN GROUP (ORDER BY ms))::float8 AS p50_ms,
           (percentile_cont(0.95) WITHIN GROUP (ORDER BY ms))::float8 AS p95_ms,
           (percentile_cont(0.99) WITHIN GROUP (ORDER BY ms))::float8 AS p99_ms
    FROM x
)
SELECT s.*,
       now() AS now,
       (SELECT count(*) FROM (
            SELECT 1 FROM {queue}
            WHERE subqueue = 'F' AND last_processed > now() - make_interval(secs => $1::float8)
              AND (s.processed < $2 OR last_processed >= s.since)
            LIMIT $2) AS f) AS failed
FROM s;

-- ops_history --
-- A queue's recent history in $2 buckets of $1 seconds, oldest first, ending with the bucket now is in: per bucket, rows that went to X (at most $3 read, so a bucket at $3 is a lower bound) with their latency p50/p95/p99 (ms), and rows that went to F (at most $3). Every bucket is one range of the done index.
WITH buckets AS (
    SELECT to_timestamp((floor(extract(epoch FROM now()) / $1::float8) - k) * $1::float8) AS start
    FROM generate_series(0, $2::int - 1) AS k
)
SELECT b.start, x.processed, x.p50_ms, x.p95_ms, x.p99_ms, f.failed
FROM buckets AS b
CROSS JOIN LATERAL (
    SELECT count(*) AS processed,
           (percentile_cont(0.50) WITHIN GROUP (ORDER BY s.ms))::float8 AS p50_ms,
           (percentile_cont(0.95) WITHIN GROUP (ORDER BY s.ms))::float8 AS p95_ms,
           (percentile_cont(0.99) WITHIN GROUP (ORDER BY s.ms))::float8 AS p99_ms
    FROM (
        SELECT extract(epoch FROM last_processed - retry_time) * 1000 AS ms
        FROM {queue}
        WHERE subqueue = 'X' AND last_processed >= b.start
          AND last_processed < b.start + make_interval(secs => $1::float8)
        LIMIT $3
    ) AS s
) AS x
CROSS JOIN LATERAL (
    SELECT count(*) AS failed FROM (
        SELECT 1 FROM {queue}
        WHERE subqueue = 'F' AND last_processed >= b.start
          AND last_processed < b.start + make_interval(secs => $1::float8)
        LIMIT $3
    ) AS s
) AS f
ORDER BY b.start;

-- ops_table_rows --
-- Rows of table $2 in schema $1 (both unquoted): the statistics system's live-row count and the table's size in pages; NULLs when there is no such table.
SELECT z.live_rows, z.pages
FROM to_regclass(format('%I.%I', $1::text, $2::text)) AS t,
     LATERAL ({tree_size(table => t)}) AS z
WHERE t IS NOT NULL;

-- ops_saga_count --
-- How many sagas of any type the endpoint's saga table holds, exactly (small tables only; see ops_table_rows).
SELECT count(*) FROM {saga};

-- ops_blocked_sequences --
-- Sequences of a queue held back by their head (the lowest id not in X): in F (blocked until an operator requeues or purges it) or in R (waiting for a retry or a deferred time). Per sequence: key, blocking_id, its subqueue, attempts, retry_time, members waiting behind it, error (first line of error_info, at most 1 000 characters). F first, then oldest head; at most $1 rows. Walks the sequence index only.
SELECT h.sequence_key, h.id AS blocking_id, h.subqueue, h.retry_count AS attempts, h.retry_time,
       (SELECT count(*) FROM {queue} AS w
        WHERE w.sequence_key = h.sequence_key AND w.id > h.id AND w.subqueue <> 'X') AS waiting,
       left(split_part(coalesce(h.error_info, ''), E'\n', 1), 1000) AS error
FROM (
    SELECT DISTINCT ON (sequence_key) sequence_key, id, subqueue, retry_count, retry_time,
           error_info
    FROM {queue}
    WHERE sequence_key IS NOT NULL AND subqueue <> 'X'
    ORDER BY sequence_key, id
) AS h
WHERE h.subqueue = 'F' OR (h.subqueue = 'R' AND h.retry_time > now())
ORDER BY h.subqueue = 'F' DESC, h.id
LIMIT $1;

-- ops_failed_list --
-- Failed rows of a queue, oldest first, optionally only type $1 (NULL: all), at most $2 rows; error is the first line of error_info.
SELECT id, label, retry_count, insert_time, last_processed,
       split_part(coalesce(error_info, ''), E'\n', 1) AS error
FROM {queue}
WHERE subqueue = 'F' AND ($1::text IS NULL OR label = $1)
ORDER BY id
LIMIT $2;

-- ops_failed_page --
-- One page of the failed rows of a queue, newest first: ids below $1 (NULL: from the newest), type $2 (NULL: any), error_info containing $3 (plain text, any case; NULL: any), at most $4 rows; error is the first line of error_info, at most $5 characters of it (error_cut: it was longer). F rows are read through the done index.
SELECT id, label, retry_count, insert_time, last_processed,
       left(e.line, $5) AS error, length(e.line) > $5 AS error_cut
FROM {queue}, LATERAL (SELECT split_part(coalesce(error_info, ''), E'\n', 1) AS line) AS e
WHERE subqueue = 'F' AND ($1::bigint IS NULL OR id < $1)
  AND ($2::text IS NULL OR label = $2)
  AND ($3::text IS NULL OR strpos(lower(error_info), lower($3)) > 0)
ORDER BY id DESC
LIMIT $4;

-- ops_failed_count --
-- How many failed rows match: $1 ids[] (NULL: any), $2 type (NULL: any), $3 text error_info contains (any case; NULL: any). With the highest id among them and the time of the count, which bind a later requeue or purge to the rows counted (see ops_requeue_failed).
SELECT count(*) AS n, max(id) AS max_id, clock_timestamp() AS counted_at FROM {queue}
WHERE subqueue = 'F' AND ($1::bigint[] IS NULL OR id = ANY($1::bigint[]))
  AND ($2::text IS NULL OR label = $2)
  AND ($3::text IS NULL OR strpos(lower(error_info), lower($3)) > 0);

-- ops_message --
-- Every column of row $1 of a queue (headers as JSON text); error_info, msg_text and msg_headers cut at $2 characters (NULL: whole), with their whole lengths.
SELECT id, from_endpoint, to_endpoint, subqueue, insert_time, last_processed, retry_count,
       retry_time, left(error_info, coalesce($2, length(error_info))) AS error_info,
       correlation_id, label, left(msg_text, coalesce($2, length(msg_text))) AS msg_text,
       left(msg_headers::text, coalesce($2, length(msg_headers::text))) AS msg_headers,
       unique_id, handling_client_id, lease_expires, isolated, priority, sequence_key,
       expires_at,
       coalesce(length(error_info), 0) AS error_info_chars,
       coalesce(length(msg_text), 0) AS msg_text_chars,
       coalesce(length(msg_headers::text), 0) AS msg_headers_chars
FROM {queue} WHERE id = $1;

-- ops_message_text --
-- One text column of row $1 of a queue, whole: $2 is 'error' (error_info), 'body' (msg_text) or 'headers' (msg_headers as JSON text). No row: no such message.
SELECT CASE $2::text WHEN 'error' THEN error_info WHEN 'body' THEN msg_text
                     WHEN 'headers' THEN msg_headers::text END AS text
FROM {queue} WHERE id = $1;

-- ops_requeue_failed --
-- Move up to $4 failed rows back to I as fresh messages (attempts reset, ready now, no lease; error_info kept as history) and wake the queue's workers.
-- $1 ids[] (NULL: any), $2 type (NULL: any), $3 notify channel, $4 batch size, $5 queue name (the NOTIFY payload), $6 text error_info contains (any case; NULL: any).
-- $7 highest id and $8 latest failure time (NULL: any) bind it to the rows an ops_failed_count counted: rows that failed after it stay.
WITH picked AS (
    SELECT id FROM {queue}
    WHERE subqueue = 'F' AND ($1::bigint[] IS NULL OR id = ANY($1::bigint[]))
      AND ($2::text IS NULL OR label = $2)
      AND ($6::text IS NULL OR strpos(lower(error_info), lower($6)) > 0)
      AND ($7::bigint IS NULL OR id <= $7)
      AND ($8::timestamptz IS NULL OR coalesce(last_processed, '-infinity') <= $8)
    ORDER BY id
    LIMIT $4
    FOR UPDATE SKIP LOCKED
), moved AS (
    UPDATE {queue} AS q
    SET subqueue = 'I', retry_count = 0, retry_time = now(),
        handling_client_id = NULL, lease_expires = NULL
    FROM picked WHERE q.id = picked.id
    RETURNING q.id
)
SELECT count(*) AS moved,
       CASE WHEN count(*) > 0 THEN pg_notify($3, $5) END AS notified
FROM moved;

-- ops_purge_failed --
-- Delete up to $3 failed rows. $1 ids[] (NULL: any), $2 type (NULL: any), $4 text error_info contains (any case; NULL: any), $5 and $6 as $7 and $8 of ops_requeue_failed. Returns how many.
WITH picked AS (
    SELECT id FROM {queue}
    WHERE subqueue = 'F' AND ($1::bigint[] IS NULL OR id = ANY($1::bigint[]))
      AND ($2::text IS NULL OR label = $2)
      AND ($4::text IS NULL OR strpos(lower(error_info), lower($4)) > 0)
      AND ($5::bigint IS NULL OR id <= $5)
      AND ($6::timestamptz IS NULL OR coalesce(last_processed, '-infinity') <= $6)
    ORDER BY id
    LIMIT $3
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM {queue} AS q USING picked WHERE q.id = picked.id RETURNING 1
)
SELECT count(*) FROM gone;

-- ops_subscriptions --
-- Every subscription, live or expired, optionally of publisher $1 only (NULL: all).
SELECT publisher_endpoint, subscriber_endpoint, message_type, created_date, expiration_date,
       (expiration_date IS NULL OR expiration_date > now()) AS live
FROM {schema}.subscriptions
WHERE $1::text IS NULL OR publisher_endpoint = $1
ORDER BY publisher_endpoint, message_type, subscriber_endpoint;

-- ops_queue_segments --
-- The segments of the queue tables $2 (names[]) of schema $1 (both unquoted), from the catalogue alone: a partitioned queue table's partitions (pg_inherits), or the table itself when it is not partitioned. Per segment: its queue, table name and oid, its bounds (low_id inclusive, high_id exclusive; NULL: MINVALUE or MAXVALUE, or a table not partitioned), whether it is a range partition (or the whole table), its rows estimated as ops_rows_estimate does, and its size with indexes and TOAST (0 once dropped).
WITH t AS (
    SELECT c.oid, c.relname, c.relkind
    FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
    WHERE n.nspname = $1 AND c.relname = ANY($2::text[]) AND c.relkind IN ('r', 'p')
), s AS (
    SELECT t.relname AS queue, p.oid, p.relname AS name, pg_get_expr(p.relpartbound, p.oid) AS bound
    FROM t
    JOIN pg_inherits AS i ON i.inhparent = t.oid
    JOIN pg_class AS p ON p.oid = i.inhrelid
    WHERE t.relkind = 'p'
    UNION ALL
    SELECT t.relname, t.oid, t.relname, NULL FROM t WHERE t.relkind = 'r'
)
SELECT s.queue, s.name, s.oid,
       (regexp_match(s.bound, 'FROM \(''?(-?[0-9]+)''?\)'))[1]::bigint AS low_id,
       (regexp_match(s.bound, 'TO \(''?(-?[0-9]+)''?\)'))[1]::bigint AS high_id,
       s.bound IS NULL OR s.bound LIKE 'FOR VALUES FROM %' AS ranged,
       greatest(coalesce(st.n_live_tup, 0), c.reltuples::bigint, 0) AS rows,
       coalesce(pg_total_relation_size(s.oid), 0) AS size_bytes
FROM s
JOIN pg_class AS c ON c.oid = s.oid
LEFT JOIN pg_stat_user_tables AS st ON st.relid = s.oid
ORDER BY s.queue, s.name;

-- ops_segment_probe --
-- What the catalogue cannot say of a queue's segments, never a scan of X rows. $1 oids[] of the segments (ops_queue_segments), $2 and $3 the first and last id each may hold (inclusive; a segment not ranged gets an empty range). Per segment, by its position k in $1 (from 1): the insert_time of its lowest and highest id (one probe of the primary key each, in that segment alone: partition pruning), and pending, its rows not in X, exactly: I and R through the ready index (and the sequence index for members parked at retry_time 'infinity'), F through the done index, counted per segment by tableoid.
WITH pending AS (
    SELECT p.tableoid, count(*) AS n FROM (
        SELECT tableoid FROM {queue} WHERE subqueue IN ('I', 'R') AND retry_time < 'infinity'
        UNION ALL
        SELECT tableoid FROM {queue}
        WHERE sequence_key IS NOT NULL AND subqueue <> 'X' AND retry_time = 'infinity'
          AND subqueue IN ('I', 'R')
        UNION ALL
        SELECT tableoid FROM {queue} WHERE subqueue = 'F'
    ) AS p
    GROUP BY p.tableoid
)
SELECT s.k, o.insert_time AS oldest, w.insert_time AS newest, coalesce(p.n, 0) AS pending
FROM unnest($1::oid[], $2::bigint[], $3::bigint[]) WITH ORDINALITY AS s(oid, low, high, k)
LEFT JOIN LATERAL (
    SELECT insert_time FROM {queue} WHERE id >= s.low AND id <= s.high ORDER BY id LIMIT 1
) AS o ON true
LEFT JOIN LATERAL (
    SELECT insert_time FROM {queue} WHERE id >= s.low AND id <= s.high ORDER BY id DESC LIMIT 1
) AS w ON true
LEFT JOIN pending AS p ON p.tableoid = s.oid
ORDER BY s.k;

-- cancel_unique --
-- Cancel the message of unique_id $1 (nmbus/delivery/cancellation.py) unless a worker
-- holds it or it is done: in I or R with no live lease, it goes to F with
-- error_info $2 (which starts 'Cancelled'). One statement: a claim that locked
-- the row first has leased it when this statement sees it again, so it is left
-- to run; a claim that comes after finds it in F.
-- Returns how many (0 or 1).
WITH cancelled AS (
    UPDATE {queue} AS q
    SET subqueue = 'F', error_info = $2, last_processed = clock_timestamp(),
        handling_client_id = NULL, lease_expires = NULL
    FROM {unique_table} AS u
    WHERE u.unique_id = $1 AND q.id = u.id
      AND q.subqueue IN ('I', 'R') AND (q.lease_expires IS NULL OR q.lease_expires < now())
    RETURNING 1
)
SELECT count(*) FROM cancelled;

-- cancel_correlated --
-- Cancel every message of correlation_id $1 that no worker holds and that is
-- not done, as cancel_unique does (error_info $2). $3 is the queue's ready floor
-- (nmbus/postgres/floor.py), read just before: no message waits below it, so the
-- segments below are not read. Returns how many.
WITH cancelled AS (
    UPDATE {queue} AS q
    SET subqueue = 'F', error_info = $2, last_processed = clock_timestamp(),
        handling_client_id = NULL, lease_expires = NULL
    WHERE q.correlation_id = $1 AND q.id >= $3
      AND q.subqueue IN ('I', 'R') AND (q.lease_expires IS NULL OR q.lease_expires < now())
    RETURNING 1
)
SELECT count(*) FROM cancelled;
