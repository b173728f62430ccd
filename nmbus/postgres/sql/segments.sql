-- Segments (nmbus/postgres/segments.py, docs/storage.md "Segments"): the
-- partitions of a queue table by ranges of id. Segment n holds ids from
-- n * 2^36 up to (n + 1) * 2^36; {segment}, {lower} and {upper} are filled in by
-- nmbus.postgres.sql.render_segment. New rows go to the segment of the next
-- value of the queue's identity sequence: the roll moves that value to the next
-- segment's lower bound once the next segment exists, so an insert never lacks
-- a segment.

-- segment_list --
-- The segments of queue table $1 (schema-qualified and quoted, as regclass text):
-- name, number and comment (segment_opened), lowest first; a plain (unsegmented)
-- table is not listed.
SELECT name, number, note FROM ({segment_catalog}) AS s
ORDER BY number;

-- segment_catalog --
-- Fragment of segment_list and ready_floor: the segments of queue table $1
-- (see segment_list), in no order.
SELECT c.relname AS name,
       substr(c.relname, length(p.relname) + 3)::bigint AS number,
       obj_description(c.oid, 'pg_class') AS note,
       c.oid AS relid
FROM pg_inherits AS i
JOIN pg_class AS c ON c.oid = i.inhrelid
JOIN pg_class AS p ON p.oid = i.inhparent
WHERE i.inhparent = to_regclass($1)
  AND c.relname = p.relname || '$s' || substr(c.relname, length(p.relname) + 3)
  AND substr(c.relname, length(p.relname) + 3) ~ '^[0-9]+$'

-- ready_floor --
-- The worker's ready floor (nmbus/postgres/floor.py) of queue table $1 (see
-- segment_list); $2 is the span of a segment's ids. `ready`: the number of the
-- lowest segment holding a row of the ready index (I or R, leased or not) or
-- of the sequence index (a member of a sequence not in X: one that holds its
-- sequence back, or a parked one), or NULL. `segments`: how many segments the
-- table has (none: it is not segmented). `next_id`: the id the next insert
-- gets. Each segment is probed through the queue table with its id range, so
-- a probe prunes to that segment's two small partial indexes, and a segment
-- dropped meanwhile is simply not found. `grouped`: whether any ready row
-- carries a group (the group index is not empty): the worker then claims with
-- claim_fair.
SELECT min(CASE WHEN EXISTS (
                    SELECT 1 FROM {queue} AS q
                    WHERE q.subqueue IN ('I', 'R') AND q.retry_time < 'infinity'
                      AND q.id >= {segment_floor} AND q.id < (s.number + 1) * $2)
                  OR EXISTS (
                    SELECT 1 FROM {queue} AS q
                    WHERE q.sequence_key IS NOT NULL AND q.subqueue <> 'X'
                      AND q.id >= {segment_floor} AND q.id < (s.number + 1) * $2)
           THEN s.number END) AS ready,
       count(*) AS segments,
       (SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END
        FROM {id_seq}) AS next_id,
       EXISTS (SELECT 1 FROM {queue} AS q
               WHERE q.subqueue IN ('I', 'R') AND q.retry_time < 'infinity'
                 AND q.msg_headers ? 'nmbus-group') AS grouped
FROM ({segment_catalog}) AS s;

-- outgrown_segments --
-- Of segments $2 (numbers) of queue table $1 (see segment_list), those whose
-- planner statistics a burst has outgrown (nmbus/postgres/outgrown.py): the
-- worker's claims took a full batch from each, while its statistics say it
-- holds fewer than $3 ready rows (its rows at the last analyze times the share
-- of every value of `subqueue` but X and F, the values left out of the most
-- common ones included). Left out: a segment this role may not analyze (it
-- does not own it).
SELECT s.number
FROM ({segment_catalog}) AS s
JOIN pg_class AS c ON c.oid = s.relid
JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE s.number = ANY ($2::bigint[])
  AND pg_has_role(c.relowner, 'USAGE')
  AND greatest(c.reltuples, 0) * coalesce(
        (SELECT 1 - coalesce(sum(m.f) FILTER (WHERE m.v IN ('X', 'F')), 0)
         FROM pg_stats AS p,
              unnest(p.most_common_vals::text::text[], p.most_common_freqs) AS m(v, f)
         WHERE p.schemaname = n.nspname AND p.tablename = s.name
           AND p.attname = 'subqueue'), 1) < $3
ORDER BY s.number;

-- analyze_segment --
-- Renew the planner statistics of one segment (nmbus/postgres/outgrown.py).
ANALYZE {segment};

-- segment_floor --
-- Fragment of ready_floor: the lowest id segment s.number holds (segment 0
-- from the lowest bigint).
CASE WHEN s.number = 0 THEN '-9223372036854775808'::bigint ELSE s.number * $2 END

-- segment_next_id --
-- The id the next insert into the queue gets (or a later one).
SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END FROM {id_seq};

-- segment_opened --
-- Note on the segment when new rows start to go to it (psql's \dt+ shows it):
-- rows moved into it later keep their own, older, insert_time, so the roll
-- counts the segment's time from here. {opened} is a timestamp nmbus formats.
COMMENT ON TABLE {segment} IS {opened};

-- segment_oldest_transaction --
-- When the oldest transaction open in this database (other than this session's)
-- began; NULL when there is none.
SELECT min(xact_start) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND xact_start IS NOT NULL;

-- segment_oldest --
-- When the first row of the segment was inserted (NULL: the segment is empty).
SELECT insert_time FROM {segment} ORDER BY id LIMIT 1;

-- segment_advance --
-- Move the queue's identity to the first id of the segment: later inserts go
-- there. Run only under the queue's segment lock (advisory_lock), after the segment was created, and only
-- forward (the caller checks), so no id is ever handed out twice. $1: that id.
SELECT setval(pg_get_serial_sequence($2, 'id'), $1, false);

-- segment_pins --
-- What keeps the segment from being dropped, by four index probes (none reads
-- the X rows): an X row processed less than $1 (interval) ago; an I/R row in the
-- ready index; a sequence member not in X; an F row processed less than $2 ago
-- or at an unknown time ($2 NULL: any F row).
SELECT EXISTS (SELECT 1 FROM {segment} WHERE subqueue = 'X'
               AND (last_processed >= now() - $1::interval OR last_processed IS NULL))
           AS recent,
       EXISTS (SELECT 1 FROM {segment} WHERE subqueue IN ('I', 'R')
               AND retry_time < 'infinity') AS ready,
       EXISTS (SELECT 1 FROM {segment} WHERE sequence_key IS NOT NULL
               AND subqueue <> 'X') AS sequenced,
       EXISTS (SELECT 1 FROM {segment} WHERE subqueue = 'F'
               AND ($2::interval IS NULL OR last_processed IS NULL
                    OR last_processed >= now() - $2::interval))
           AS failed;

-- segment_ripe --
-- Whether retention rolls the segment being written before it drops old ones, so
-- that this same run drops it: it holds an X row processed more than $1
-- (interval) ago, and nothing of what segment_pins calls recent or sequenced,
-- which would keep it anyway (an X row processed less than $1 ago or at an
-- unknown time, a sequence member not in X). Three index probes, none reads the
-- X rows. Rows a run moves (F, I/R no live lease holds) do not keep it.
SELECT EXISTS (SELECT 1 FROM {segment} WHERE subqueue = 'X'
               AND last_processed < now() - $1::interval)
       AND NOT EXISTS (SELECT 1 FROM {segment} WHERE subqueue = 'X'
                       AND (last_processed >= now() - $1::interval OR last_processed IS NULL))
       AND NOT EXISTS (SELECT 1 FROM {segment} WHERE sequence_key IS NOT NULL
                       AND subqueue <> 'X');

-- segment_movable --
-- Lock the rows of the segment that wait for something other than time and may
-- move to the segment being written, so they do not keep an old segment alive: F rows
-- processed less than $1 (interval) ago or at an unknown time ($1 NULL: every F
-- row), and I/R rows no
-- live lease holds; never a sequence member (its id is its place in the sequence).
-- Returns their ids and unique_ids, at most $2.
SELECT id, unique_id FROM {segment}
WHERE sequence_key IS NULL
  AND ((subqueue = 'F' AND ($1::interval IS NULL OR last_processed IS NULL
                            OR last_processed >= now() - $1::interval))
       OR (subqueue IN ('I', 'R') AND (lease_expires IS NULL OR lease_expires < now())))
ORDER BY id
LIMIT $2
FOR UPDATE SKIP LOCKED;

-- segment_release_unique --
-- Free the unique_ids $1 held by the rows $2 about to move (segment_move inserts
-- them again), and mark the transaction as a move: a moved row that does not hold
-- its unique_id (a unique window let a newer row take it) is kept, not dropped.
WITH freed AS (
    DELETE FROM {unique_table} WHERE unique_id = ANY($1::text[]) AND id = ANY($2::bigint[])
)
SELECT set_config('nmbus.moving', 'on', true);

-- segment_move --
-- Move the rows $1 (locked by segment_movable) to the segment being written: the
-- same row with a new id, every other column kept. Returns how many moved.
WITH gone AS (
    DELETE FROM {queue} WHERE id = ANY($1::bigint[]) RETURNING *
), moved AS (
    INSERT INTO {queue} (from_endpoint, to_endpoint, subqueue, insert_time, last_processed,
                         retry_count, retry_time, error_info, correlation_id, label, msg_text,
                         msg_headers, unique_id, handling_client_id, lease_expires, isolated,
                         priority, sequence_key, expires_at)
    SELECT from_endpoint, to_endpoint, subqueue, insert_time, last_processed, retry_count,
           retry_time, error_info, correlation_id, label, msg_text, msg_headers, unique_id,
           handling_client_id, lease_expires, isolated, priority, sequence_key, expires_at
    FROM gone ORDER BY id
    RETURNING 1
)
SELECT count(*) FROM moved;

-- segment_rows --
-- Every row of the segment, lowest id first, headers as JSON text: what the
-- archive holds.
SELECT id, from_endpoint, to_endpoint, subqueue, insert_time, last_processed, retry_count,
       retry_time, error_info, correlation_id, label, msg_text, msg_headers::text AS msg_headers,
       unique_id, handling_client_id, lease_expires, isolated, priority, sequence_key, expires_at
FROM {segment} ORDER BY id;

-- segment_count --
-- How many X and F rows the segment holds (an index-only read of its done index;
-- the X rows themselves are not read): what a drop removes once nothing else is
-- left in it, and what retention_due counts.
SELECT count(*) FILTER (WHERE subqueue = 'X') AS x, count(*) FILTER (WHERE subqueue = 'F') AS f
FROM {segment} WHERE subqueue IN ('X', 'F');

-- bound_lock_wait --
-- For the rest of the caller's transaction, a lock not granted within $1 (text:
-- '200ms') fails with lock_not_available instead of waiting on.
SELECT set_config('lock_timeout', $1, true);

-- segment_lock_queue --
-- Take the queue table for the drop of a segment (DROP takes the same lock: taken
-- first, the wait for it is bounded by the caller's lock_timeout).
LOCK TABLE {queue} IN ACCESS EXCLUSIVE MODE;

-- segment_size --
-- The bytes segment $1 (schema-qualified and quoted, as regclass text) takes on
-- disk, its indexes and TOAST included: what its drop gives back to the system.
SELECT pg_total_relation_size($1::text::regclass);

-- segment_drop --
-- Drop the segment, its rows and its indexes: the space goes back to the system.
DROP TABLE {segment};

-- segment_forget_unique --
-- Delete the entries of the unique table with ids from $1 up to (not including)
-- $2: those of dropped segments (a range of the id index; the one per-row work
-- left to retention, on rows of two columns), but for those of a unique_for
-- window not yet over (docs/messages.md, "Unique windows"). Returns how many.
WITH gone AS (
    DELETE FROM {unique_table} WHERE id >= $1 AND id < $2
        AND (until IS NULL OR until <= now()) RETURNING 1
)
SELECT count(*) FROM gone;
