-- Held batches (setting held_batches; nmbus/postgres/held.py): a batch's own
-- transaction holds its rows, and each row is written once, when it finishes.
-- The claim is claim_ready's (runtime.sql) without its write; the finish is
-- finish_done with the attempt counted there. A record of the batch, on a
-- second connection, is what a crash leaves; recover_held reads it.
-- claim_held --
-- The claim of a held batch (setting held_batches; docs/reliability.md): in the
-- batch's own transaction, lock up to $1 ready rows at or above the ready floor
-- $2, as claim does, and write nothing; the rows stay locked until the batch
-- commits, and held_record says, before the handlers run, which rows it holds.
-- The same columns as claim, retry_count already this attempt's number. They
-- are read FOR UPDATE too: a row another transaction changed (and committed)
-- between this statement's snapshot and `ready` locking it is read as it is
-- now, as `ready` saw it, not as the snapshot had it (a recovery's counted
-- attempt, say). The rows are this transaction's already: nothing waits.
WITH {claim_ready(limit => $1, floor => $2, sequence_filter => '', row_filter => '')}
SELECT {claimed_columns(attempt => held_attempt)}
FROM {queue} AS q
WHERE q.id = ANY (ARRAY(SELECT id FROM ready)) AND q.id >= $2
FOR UPDATE OF q;

-- held_record --
-- The record of held batch $1 (a random bigint), committed on a connection
-- other than the batch's before its handlers run: holder $2 (the advisory lock
-- its loop's connection holds), client $3, rows $4. Not written when a record
-- already names one of the rows: a claim whose snapshot was taken before a
-- batch's record committed, and that locked its rows after that batch's
-- holder died, must not run them as if no attempt had died on them. Returns
-- whether it was written; when not, the batch is given up (its transaction
-- rolled back) and recover_held counts the dead attempt first.
WITH overlap AS (
    SELECT 1 FROM {held} WHERE ids && $4::bigint[] LIMIT 1
), ins AS (
    INSERT INTO {held} (batch, holder, client, ids)
    SELECT $1, $2, $3, $4::bigint[] WHERE NOT EXISTS (SELECT 1 FROM overlap)
    RETURNING 1
)
SELECT count(*) FROM ins;

-- finish_held --
-- finish for a held batch, in its transaction: $1..$5 as finish, $6 its record.
-- Each row is written once: its outcome, with the attempt counted; the record
-- goes with the same commit.
WITH {record_gone(batch => $6)},
{finish_done(floor => lowest_id, counted => held_attempt, owned => held_row)},
{unparked(floor => lowest_id)}
SELECT count(*) FROM done;

-- record_gone --
-- Fragment of finish_held, finish_held_processed and lease_held: the CTE `gone`,
-- which drops the record of held batch {:batch} (with the statement's commit).
gone AS (
    DELETE FROM {held} WHERE batch = {:batch}
)

-- finish_held_processed --
-- finish_held for the batch (or part) whose every message was processed: rows
-- $1 of held batch $2 go to X with their attempt counted.
WITH {record_gone(batch => $2)},
done AS (
    UPDATE {queue} AS q
    SET subqueue = 'X', last_processed = clock_timestamp(),
        retry_count = {held_attempt}
    WHERE q.id = ANY($1::bigint[]) AND {held_row} AND q.id >= {lowest_id}
    RETURNING q.id, q.subqueue, q.sequence_key
),
{unparked(floor => lowest_id)}
SELECT count(*) FROM done;

-- lease_held --
-- A held batch becomes a leased one, as if claim had claimed it: at its claim
-- when it holds a crash's suspect (isolate is the leased path's), at a part
-- commit (in its transaction, before the commit lets go of its rows' locks; the
-- part's finish_held has dropped the record already), or after its transaction
-- was rolled back (its record still keeps every claim away from its rows, and
-- its holder lives: no other process takes them meanwhile). Rows $1 still in I
-- or R with no live lease get client $3's lease of $4 seconds and their attempt
-- counted; record $2 goes. Returns how many rows were leased.
WITH {record_gone(batch => $2)},
leased AS (
    UPDATE {queue} AS q
    SET retry_count = {held_attempt},
        isolated = false,
        handling_client_id = $3,
        lease_expires = now() + make_interval(secs => $4)
    WHERE q.id = ANY($1::bigint[]) AND q.id >= {lowest_id}
      AND q.subqueue IN ('I', 'R') AND (q.lease_expires IS NULL OR q.lease_expires < now())
    RETURNING 1
)
SELECT count(*) FROM leased;

-- recover_held --
-- The records of held batches whose holder is gone (its connection closed: a
-- crash, a lost connection) are taken as what a lease that ran out leaves:
-- their rows still in I or R get the attempt that died counted and, when not
-- leased, an expired lease of the record's client, so the next claim takes them
-- as recovered (isolate). A row leased meanwhile was taken by a leased claim
-- whose snapshot predated the record (it locked the row once the holder died):
-- its lease is left to run, its count still gets the dead attempt. A holder is
-- gone when its advisory lock can be taken; $1, a holder this connection holds
-- itself (or 0), is never taken for gone. Returns how many rows.
WITH dead AS (
    DELETE FROM {held} AS h
    WHERE h.holder <> $1 AND pg_try_advisory_xact_lock(h.holder)
    RETURNING h.client, h.ids
), recovered AS (
    UPDATE {queue} AS q
    SET retry_count = {held_attempt},
        handling_client_id = CASE WHEN q.lease_expires IS NULL THEN d.client
                                  ELSE q.handling_client_id END,
        isolated = q.isolated AND q.lease_expires IS NOT NULL,
        lease_expires = coalesce(q.lease_expires, 'epoch')
    FROM dead AS d
    WHERE q.id = ANY(d.ids) AND q.subqueue IN ('I', 'R')
    RETURNING 1
)
SELECT count(*) FROM recovered;

-- take_holder --
-- The advisory lock that says a loop's connection lives, held for its session
-- (released when it closes): key $1 (at or above 2^32, out of the range of the
-- hashtext keys of advisory_lock). Whether it was free. The session's
-- idle_in_transaction_session_timeout, and from PostgreSQL 17 on its
-- transaction_timeout, are turned off: a held batch's transaction waits for its
-- handlers (bounded by their timeouts), and a server that ended it would stop
-- them and have the batch run again as a crash's.
SELECT pg_try_advisory_lock($1::bigint),
       set_config('idle_in_transaction_session_timeout', '0', false),
       CASE WHEN current_setting('server_version_num')::int >= 170000
            THEN set_config('transaction_timeout', '0', false) END;

-- held_attempt --
-- Fragment of the held statements: the attempt counted where a held batch
-- counts it (its finish, its lease, its recovery), saturating as claim_lease
-- does.
least(q.retry_count, 2147483646) + 1

-- held_row --
-- Fragment of finish_held and finish_held_processed: a row of a held batch
-- (locked by its transaction since the claim; never leased).
q.lease_expires IS NULL
