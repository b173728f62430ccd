-- What workers and senders run: a tick's insert, claim, finish, leases,
-- isolation and the release of parked sequence members (new messages: insert.sql).
--
-- Each part is written once, as a fragment the statements put in by name: the
-- claim (claim_ready, sequence_head, claim_lease) serves claim and, through
-- claim_after_finish, finish_claim and finish_claim_processed; the finish of
-- finish and finish_claim is finish_done; what moving a sequence member to X
-- does to the next member is unparked.

-- insert_tick --
-- Enqueue the tick of schedule $8 due at $9 into endpoint $1's own queue, unless a
-- tick of that schedule due at $9 or later was enqueued before, and record $9 as
-- its latest due time: one statement, so the record and the row commit together.
-- Two processes trying the same due time serialise on the record's row; the
-- second finds last_due = $9 and inserts nothing. A record more than a minute
-- ahead of the database's clock (a process whose clock ran ahead) is not trusted:
-- any due time replaces it, so that process cannot stop the schedule for the
-- others until their clocks catch up. The unique table still keeps a
-- row whose tick was enqueued before the record existed. $2 correlation_id,
-- $3 label, $4 msg_text, $5 msg_headers (JSON text), $6 unique_id, $7 notify
-- channel. Returns how many rows were inserted (0 or 1).
WITH due AS (
    INSERT INTO {schema}."periodic$due" AS d (endpoint, schedule, last_due)
    VALUES ($1, $8, $9)
    ON CONFLICT (endpoint, schedule) DO UPDATE
        SET last_due = excluded.last_due, recorded_at = now()
        WHERE d.last_due < excluded.last_due OR d.last_due > now() + interval '1 minute'
    RETURNING 1
), ins AS (
    INSERT INTO {queue} (from_endpoint, to_endpoint, correlation_id, label, msg_text,
                         msg_headers, unique_id)
    SELECT $1, $1, $2, $3, $4, $5::jsonb, $6
    WHERE EXISTS (SELECT 1 FROM due)
    RETURNING 1
)
SELECT count(*) AS inserted, pg_notify($7, $1) FROM ins;

-- claim --
-- Claim up to $1 ready rows (I, or R that is due) that no live lease holds,
-- as claim $2 (the token of this one claim: nmbus/consume/claim.py) with a
-- lease of $3 seconds; counts the attempt (saturating, so
-- a hand-written retry_count cannot overflow the claim). `recovered`: 0 fresh,
-- 1 let go by `isolate` to be tried alone, 2 the holder's lease ran out with
-- the row in a batch, 3 it ran out with the row isolated (the holder died on it).
-- Highest priority first, then ready-time order. A member of a sequence is
-- ready only when every earlier member (lower id, same sequence_key) is in X,
-- i.e. it is the lowest member not in X: so at most one member of a sequence is
-- ever held, and R and F members hold the rest back. That is checked only for
-- rows with a sequence_key, by one probe of the sequence index; the members
-- behind a head are parked out of the ready index anyway (see insert_messages).
-- `expired`: the row's expires_at has passed; the worker records it without
-- running a handler. $4: the queue's ready floor, an id below which no row is
-- ready (nmbus/postgres/floor.py): the segments below it are left out when the
-- statement starts.
WITH {claim_ready(limit => $1, floor => $4, sequence_filter => '', row_filter => '')}
{claim_lease(client => $2, lease => $3, floor => $4)};

-- claim_ready --
-- Fragment of every claim (claim, claim_after_finish): the CTE `ready`, the
-- rows a claim takes and why (see claim), at most {:limit}, at or above the
-- ready floor {:floor}, locked, skipping rows another claim has locked.
-- {:sequence_filter} and {:row_filter} are
-- what a finish-and-claim adds (claim_after_finish); claim adds nothing.
ready AS (
    SELECT id, CASE WHEN lease_expires IS NULL THEN 0
                    WHEN handling_client_id IS NULL THEN 1
                    WHEN isolated THEN 3
                    ELSE 2 END AS recovered
    FROM {queue} AS r
    WHERE subqueue IN ('I', 'R') AND retry_time <= now() AND retry_time < 'infinity'
      AND (lease_expires IS NULL OR lease_expires < now())
      AND id >= {:floor}
      AND {sequence_head(floor => {:floor}, filter => {:sequence_filter})}
      {:row_filter}
    ORDER BY priority DESC, retry_time, id
    LIMIT {:limit}
    FOR UPDATE SKIP LOCKED
)

-- sequence_head --
-- Fragment of claim_ready and has_ready: row r of {queue} is in no sequence,
-- or is the head of its sequence, the lowest member not in X (one probe of the
-- sequence index). {:floor}: the ready floor, below which no member is outside
-- X either (nmbus/postgres/floor.py). {:filter}: what else a member must be to
-- hold its sequence back (claim_past_finished), or nothing.
(r.sequence_key IS NULL OR r.id = (
    SELECT e.id FROM {queue} AS e
    WHERE e.sequence_key = r.sequence_key AND e.subqueue <> 'X' AND e.id >= {:floor}
      {:filter}
    ORDER BY e.sequence_key, e.id LIMIT 1))

-- claim_lease --
-- Fragment of every claim: lease the rows of `ready` to claim {:client} for
-- {:lease} seconds and count the attempt (see claim); returns what the worker
-- reads of a claimed row. Its last columns are the expired flag and the claim,
-- which claim_after_finish names (AS expired, AS claim). The rows are named as an array of ids,
-- never joined to `ready`: the planner's estimate of `ready` comes from the
-- statistics of a queue that was empty, or nearly all in X, when last analyzed,
-- and a join planned for two rows ran once per row of a batch of 500 (a probe
-- of the primary key each, or a comparison with every other row). The array
-- keeps the update on one scan of the primary key, and the
-- ready floor {:floor} on the segments that can hold them. `recovered` is
-- looked up in arrays of the few rows a lease had held (empty in the common
-- case). The lease runs from the statement (clock_timestamp), not from its
-- transaction's start: a finish-and-claim that ends a long transaction leases
-- the next batch for as long as a claim of its own would.
UPDATE {queue} AS q
SET retry_count = least(q.retry_count, 2147483646) + 1,
    isolated = false,
    handling_client_id = {:client},
    lease_expires = clock_timestamp() + make_interval(secs => {:lease})
WHERE q.id = ANY (ARRAY(SELECT id FROM ready))
  AND q.id >= {:floor}
RETURNING {claimed_columns(attempt => q.retry_count)}

-- claimed_columns --
-- Fragment of claim_lease: what the worker reads of a claimed
-- row q of `ready` (nmbus/postgres/rows.py), {:attempt} the number of this
-- attempt; `claim` is the token the row is leased under.
q.id, q.from_endpoint, q.insert_time, {:attempt} AS retry_count, q.retry_time,
q.correlation_id, q.label, q.msg_text, q.msg_headers::text, q.unique_id,
CASE WHEN q.id = ANY (ARRAY(SELECT id FROM ready WHERE recovered = 1)) THEN 1
     WHEN q.id = ANY (ARRAY(SELECT id FROM ready WHERE recovered = 2)) THEN 2
     WHEN q.id = ANY (ARRAY(SELECT id FROM ready WHERE recovered = 3)) THEN 3
     ELSE 0 END AS recovered,
q.priority, coalesce(q.expires_at <= now(), false) AS expired, q.handling_client_id AS claim

-- finish --
-- Record the outcome of a claimed batch in one statement. Per row:
-- $1 id[], $2 new subqueue[] (X, R, F, or NULL to release it unchanged),
-- $3 retry delay seconds[] (for R), $4 error_info[] (NULL keeps the old one),
-- $5 attempt correction[] (-1 when the attempt must not count). $6 the claim
-- that took them. Only rows still leased by claim $6 change (a row whose lease
-- lapsed and that another claim took since is that claim's); returns how many did. A sequence member
-- moved to X unparks the next member of its sequence (see insert_messages).
WITH {finish_done(floor => lowest_id)},
{unparked(floor => lowest_id)}
SELECT count(*) FROM done;

-- finish_processed --
-- finish for the common batch (or part) where every message was processed:
-- rows $1 still leased by claim $2 go to X. No per-row outcome arrays to send
-- or join; returns how many rows changed, as finish does.
WITH done AS (
    UPDATE {queue}
    SET subqueue = 'X', last_processed = clock_timestamp(),
        handling_client_id = NULL, lease_expires = NULL
    WHERE id = ANY($1::bigint[]) AND handling_client_id = $2 AND id >= {lowest_id}
    RETURNING id, subqueue, sequence_key
),
{unparked(floor => lowest_id)}
SELECT count(*) FROM done;

-- finish_done --
-- Fragment of finish and finish_claim: the CTE `done`, the outcome of each row
-- of the batch (see finish for $1..$5) still leased by claim $6; its retry_count
-- becomes the attempt the claim counted plus the correction; returns the rows it
-- changed.
-- The rows are at or above {:floor} (the ready floor they were claimed at, or
-- the lowest of their ids), so only the segments that can hold them are searched.
done AS (
    UPDATE {queue} AS q
    SET subqueue = coalesce(v.subqueue, q.subqueue),
        last_processed = CASE WHEN v.subqueue IS NULL THEN q.last_processed
                              ELSE clock_timestamp() END,
        retry_time = CASE WHEN v.subqueue = 'R'
                          THEN clock_timestamp() + make_interval(secs => v.delay)
                          ELSE q.retry_time END,
        error_info = coalesce(v.error_info, q.error_info),
        retry_count = greatest(0, q.retry_count + v.correction),
        handling_client_id = NULL,
        lease_expires = NULL
    FROM unnest($1::bigint[], $2::text[], $3::float8[], $4::text[], $5::int[])
         AS v(id, subqueue, delay, error_info, correction)
    WHERE q.id = v.id AND q.handling_client_id = $6
      AND q.id >= {:floor}
    RETURNING q.id, q.subqueue, q.sequence_key
)

-- unparked --
-- Fragment of every finish (finish, finish_processed, finish_claim,
-- finish_claim_processed),
-- after their CTE `done`: the CTE `unparked`, which lets the member parked
-- behind each row moved to X be claimed (see insert_messages). The next member
-- is above the finished one, so above {:floor} too.
unparked AS (
    -- The next member of each sequence a row of `done` moved to X becomes due now.
    UPDATE {queue} AS s SET retry_time = now()
    FROM done AS d,
         LATERAL (SELECT n.id FROM {queue} AS n
                  WHERE n.sequence_key = d.sequence_key AND n.id > d.id AND n.subqueue <> 'X'
                    AND n.id >= {:floor}
                  ORDER BY n.sequence_key, n.id LIMIT 1) AS nxt
    WHERE d.sequence_key IS NOT NULL AND d.subqueue = 'X'
      AND s.id = nxt.id AND s.retry_time = 'infinity' AND s.id >= {:floor}
    RETURNING 1
)

-- finish_claim --
-- finish (same $1..$6) and, in the same statement and commit, claim the next
-- batch: up to $7 ready rows as claim $10 (a token of its own) with a lease of
-- $8 seconds at or above the ready floor $9, as claim does, never one of the
-- rows being finished. Saves a round trip and a commit
-- per batch. One row per claimed message, with the count of finished rows in
-- `finished`; a single row of NULLs beside it when nothing was claimed.
WITH {finish_done(floor => $9)},
{unparked(floor => $9)},
{claim_after_finish(limit => $7, client => $10, lease => $8, floor => $9)};

-- finish_claim_processed --
-- finish_claim for the common batch where every message was processed: mark
-- rows $1 leased by claim $2 X, then claim up to $3 more as claim $6 with a
-- lease of $4 seconds at or above the ready floor $5. No per-row outcome arrays to send
-- or join.
WITH done AS (
    UPDATE {queue}
    SET subqueue = 'X', last_processed = clock_timestamp(),
        handling_client_id = NULL, lease_expires = NULL
    WHERE id = ANY($1::bigint[]) AND handling_client_id = $2 AND id >= $5
    RETURNING id, subqueue, sequence_key
),
{unparked(floor => $5)},
{claim_after_finish(limit => $3, client => $6, lease => $4, floor => $5)};

-- claim_after_finish --
-- Fragment of finish_claim and finish_claim_processed, after their CTEs `done`
-- and `unparked`: claim up to {:limit} rows as claim {:client} with a lease of
-- {:lease} seconds at or above the ready floor {:floor}, as claim does, never one of the rows being finished ($1 of
-- both). The statement's snapshot still sees the finished rows as they were,
-- so a sequence member whose predecessor this statement moves to X is let
-- through by reading `done` (only rows really changed, i.e. still leased).
-- One row per claimed message, with the count of finished rows in `finished`;
-- a single row of NULLs beside it when nothing was claimed.
{claim_ready(limit => {:limit}, floor => {:floor},
             sequence_filter => claim_past_finished,
             row_filter => claim_not_finishing)},
claimed AS (
    {claim_lease(client => {:client}, lease => {:lease}, floor => {:floor})}
)
SELECT c.id, c.from_endpoint, c.insert_time, c.retry_count, c.retry_time,
       c.correlation_id, c.label, c.msg_text, c.msg_headers, c.unique_id, c.recovered,
       c.priority, c.expired, c.claim, d.finished
FROM (SELECT count(*) AS finished FROM done) AS d
LEFT JOIN claimed AS c ON true

-- claim_past_finished --
-- Fragment of claim_after_finish: a member whose predecessor the same statement
-- moves to X is the head of its sequence already.
AND e.id NOT IN (SELECT done.id FROM done WHERE done.subqueue = 'X')

-- claim_not_finishing --
-- Fragment of claim_after_finish: none of the rows being finished ($1).
AND id <> ALL($1::bigint[])

-- lowest_bigint --
-- Fragment of has_ready: no floor at all.
'-9223372036854775808'::bigint

-- lowest_id --
-- Fragment of the statements on a batch's ids $1 (finish, renew_leases,
-- abandon_leases, give_back, isolate): the lowest of them. A row of the batch is at or
-- above it, so a statement that says so searches only the segments from the
-- lowest one's up (PostgreSQL prunes the others as it runs, before reading).
(SELECT min(b.id) FROM unnest($1::bigint[]) AS b(id))

-- renew_leases --
-- Extend to $3 seconds from now the lease of each row $1[i] still leased by
-- claim $2[i] (a row another claim took since is left alone). Rows locked right
-- now are skipped, never waited for: they are being finished (or isolated) by
-- this very process, whose statements lock them in another order, so waiting
-- could deadlock with it and fail its batch. Returns the ids renewed.
WITH leased AS (
    SELECT q.id FROM {queue} AS q
    JOIN unnest($1::bigint[], $2::text[]) AS v(id, claim)
      ON q.id = v.id AND q.handling_client_id = v.claim
    WHERE q.id >= {lowest_id}
    FOR UPDATE OF q SKIP LOCKED
), renewed AS (
    UPDATE {queue} AS q SET lease_expires = clock_timestamp() + make_interval(secs => $3)
    FROM leased
    WHERE q.id = leased.id AND q.id >= {lowest_id}
    RETURNING q.id
)
SELECT id FROM renewed;

-- abandon_leases --
-- Let rows $1 leased by claim $2 be claimed again at once. $3: how much to take
-- off retry_count (0: the attempt stays counted; 1: it never started). Rows $4
-- (a crash's suspects, not started) keep their mark, a lease that ran out long
-- ago, so the next claim still tries them alone (as isolate lets rows go).
UPDATE {queue}
SET lease_expires = CASE WHEN id = ANY($4::bigint[]) THEN 'epoch'::timestamptz END,
    handling_client_id = NULL, retry_count = greatest(0, retry_count - $3)
WHERE id = ANY($1::bigint[]) AND handling_client_id = $2 AND id >= {lowest_id};

-- give_back --
-- Let rows $1 that claim $3 took at attempts $2 (their retry_count after the
-- claim) be claimed again at once, their attempt not counted: they never started.
-- A row claimed again since (its retry_count moved on) is left alone. Returns the
-- ids given back.
UPDATE {queue} AS q
SET lease_expires = NULL, handling_client_id = NULL, retry_count = greatest(0, q.retry_count - 1)
FROM unnest($1::bigint[], $2::int[]) AS v(id, attempt)
WHERE q.id = v.id AND q.retry_count = v.attempt AND q.handling_client_id = $3
  AND q.id >= {lowest_id}
RETURNING q.id;

-- isolate --
-- After a crash, run one suspect alone. Of rows $1 leased by claim $3, row $2
-- stays leased and is marked isolated; the others are let go at once. $4 per
-- row: whether a row let go must still be tried alone (its mark is a lease
-- that ran out long ago). $5 per row: attempts given back to a row let go:
-- this claim's (it has not started), plus the crash's when it died in a batch
-- (nothing says it was the one that killed the worker). Returns how many rows
-- changed.
WITH done AS (
    UPDATE {queue} AS q
    SET isolated = (q.id = $2),
        retry_count = CASE WHEN q.id = $2 THEN q.retry_count
                           ELSE greatest(0, q.retry_count - v.refund) END,
        handling_client_id = CASE WHEN q.id = $2 THEN q.handling_client_id END,
        lease_expires = CASE WHEN q.id = $2 THEN q.lease_expires
                             WHEN v.mark THEN 'epoch'::timestamptz END
    FROM unnest($1::bigint[], $4::bool[], $5::int[]) AS v(id, mark, refund)
    WHERE q.id = v.id AND q.handling_client_id = $3 AND q.id >= {lowest_id}
    RETURNING 1
)
SELECT count(*) FROM done;

-- release_sequences --
-- Make due every parked sequence head (retry_time 'infinity' though no earlier
-- member is left outside X): a race between a send and the finish of its
-- predecessor, or a purged/deleted member, can leave one so. Walks the sequence
-- index one key at a time (a loose index scan). Returns how many it released.
WITH RECURSIVE heads AS (
    (SELECT sequence_key, id FROM {queue}
     WHERE sequence_key IS NOT NULL AND subqueue <> 'X'
     ORDER BY sequence_key, id LIMIT 1)
    UNION ALL
    SELECT n.sequence_key, n.id
    FROM heads AS h,
         LATERAL (SELECT sequence_key, id FROM {queue}
                  WHERE sequence_key > h.sequence_key AND subqueue <> 'X'
                  ORDER BY sequence_key, id LIMIT 1) AS n
), released AS (
    UPDATE {queue} AS q SET retry_time = now()
    FROM heads
    WHERE q.id = heads.id AND q.retry_time = 'infinity' AND q.subqueue IN ('I', 'R')
    RETURNING 1
)
SELECT count(*) FROM released;

-- next_due --
-- Seconds until the earliest scheduled row is due, or NULL when none is; a
-- retry_time of 'infinity' (written by hand) means never.
SELECT extract(epoch FROM retry_time - now())::float8 FROM {queue}
WHERE subqueue IN ('I', 'R') AND retry_time > now() AND retry_time < 'infinity'
ORDER BY retry_time, id
LIMIT 1;

-- subqueue_counts --
-- Rows per subqueue of one queue.
SELECT subqueue, count(*) FROM {queue} GROUP BY subqueue;

-- has_ready --
-- Whether any row is ready now or held by a worker (used to drain a queue in tests);
-- a sequence member waiting behind an earlier member is not ready.
SELECT EXISTS (
    SELECT 1 FROM {queue} AS r
    WHERE subqueue IN ('I', 'R') AND (retry_time <= now() OR handling_client_id IS NOT NULL)
      AND {sequence_head(floor => lowest_bigint, filter => '')}
);

-- claim_fair --
-- claim ($1..$4 the same) for a queue whose ready rows carry groups
-- (send(..., group=)): the groups are served in turn, so one group's backlog
-- holds another's messages back by about one batch at most. The claim walks the
-- group index from group $5 on (a loose index scan: one probe per group, at
-- most $1 groups) and takes the first ready messages of each group it meets
-- (a batch's worth shared between them: $1 over the number of groups, at least
-- one each); beside them, the first $1 ready rows as claim sees them. Of all,
-- it takes the highest priority first, then each group's first message before
-- any group's second (rows without a group are first of their own), then
-- ready time. `walked`: the last group the walk reached, where the next claim goes on
-- from (NULL once it reached the end: start again from the first).
WITH RECURSIVE walk(g, n) AS (
    (SELECT w.msg_headers ->> 'nmbus-group', 1 FROM {queue} AS w
     WHERE {grouped_ready(row => w)} AND (w.msg_headers ->> 'nmbus-group') > $5
     ORDER BY 1 LIMIT 1)
    UNION ALL
    SELECT (SELECT w.msg_headers ->> 'nmbus-group' FROM {queue} AS w
            WHERE {grouped_ready(row => w)} AND (w.msg_headers ->> 'nmbus-group') > walk.g
            ORDER BY 1 LIMIT 1), walk.n + 1
    FROM walk WHERE walk.g IS NOT NULL AND walk.n < $1
), heads AS (
    SELECT h.id FROM walk
    CROSS JOIN LATERAL (
        SELECT r.id FROM {queue} AS r
        WHERE {grouped_ready(row => r)} AND (r.msg_headers ->> 'nmbus-group') = walk.g
          AND r.retry_time <= now() AND (r.lease_expires IS NULL OR r.lease_expires < now())
          AND {sequence_head(floor => $4, filter => '')}
        ORDER BY (r.msg_headers ->> 'nmbus-group'), r.priority DESC, r.retry_time, r.id
        LIMIT (SELECT greatest(1, $1 / greatest(count(*), 1)) FROM walk WHERE g IS NOT NULL)
        ) AS h
    WHERE walk.g IS NOT NULL
), first AS (
    SELECT r.id FROM {queue} AS r
    WHERE r.subqueue IN ('I', 'R') AND r.retry_time <= now() AND r.retry_time < 'infinity'
      AND (r.lease_expires IS NULL OR r.lease_expires < now())
      AND r.id >= $4
      AND {sequence_head(floor => $4, filter => '')}
    ORDER BY r.priority DESC, r.retry_time, r.id
    LIMIT $1
), turns AS (
    SELECT q.id, q.priority, q.retry_time,
           row_number() OVER (PARTITION BY coalesce(q.msg_headers ->> 'nmbus-group', q.id::text)
                              ORDER BY q.priority DESC, q.retry_time, q.id) AS turn
    FROM {queue} AS q
    WHERE q.id = ANY (ARRAY(SELECT id FROM heads UNION SELECT id FROM first)) AND q.id >= $4
), ready AS (
    SELECT r.id, CASE WHEN r.lease_expires IS NULL THEN 0
                      WHEN r.handling_client_id IS NULL THEN 1
                      WHEN r.isolated THEN 3
                      ELSE 2 END AS recovered
    FROM {queue} AS r
    WHERE r.id = ANY (ARRAY(SELECT id FROM turns ORDER BY priority DESC, turn, retry_time, id
                            LIMIT $1))
      AND r.id >= $4
      AND r.subqueue IN ('I', 'R') AND r.retry_time <= now() AND r.retry_time < 'infinity'
      AND (r.lease_expires IS NULL OR r.lease_expires < now())
    FOR UPDATE SKIP LOCKED
), claimed AS (
    {claim_lease(client => $2, lease => $3, floor => $4)}
)
SELECT c.*, (SELECT max(g) FROM walk WHERE n = (SELECT max(n) FROM walk)) AS walked
FROM claimed AS c;

-- grouped_ready --
-- Fragment of claim_fair: row {:row} is in the group index (a grouped row
-- in I or R, not parked) at or above the ready floor $4.
{:row}.subqueue IN ('I', 'R') AND {:row}.retry_time < 'infinity'
AND {:row}.msg_headers ? 'nmbus-group' AND {:row}.id >= $4

-- idle_limit --
-- This session's idle_in_transaction_session_timeout in milliseconds (0: none),
-- as the server, the database or the role set it. A worker session reads it
-- once as it connects: when it is shorter than its handlers may keep a batch's
-- transaction idle, each batch's transaction lifts it (SET LOCAL).
SELECT setting::bigint FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout';
