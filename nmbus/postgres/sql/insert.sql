-- What senders run to store new messages in a queue table: one message, or
-- many in one statement, given as parallel arrays.
--
-- Each part is written once, as a fragment the statements put in by name: the
-- arrays (insert_arrays, also in outbox_insert), the columns a sender gives and
-- their values (insert_columns, insert_values, also in the fan-out of
-- pubsub.sql and in insert_messages_apart of claimcheck.sql), and where a new
-- sequence member is parked (parked_retry_time).

-- insert_messages --
-- Insert messages given as parallel arrays, skipping unique_ids already stored
-- (the unique table's trigger drops them: queue_unique_table),
-- and wake the queue's workers once. $1 from_endpoint, $2 to_endpoint,
-- $3 deliver_at[], $4 correlation_id[], $5 label[], $6 msg_text[],
-- $7 msg_headers[] (JSON text), $8 unique_id[], $9 notify channel,
-- $10 priority[], $11 sequence_key[], $12 expires_at[].
-- Rows are inserted in array order, so members of a sequence get ids in send order.
-- A member behind an earlier member not in X is parked: retry_time 'infinity',
-- out of the ready index, until the finish that moves its predecessor to X (or
-- release_sequences) makes it due. Its deliver_at is then not kept.
-- Returns how many rows were inserted. For one message; more take
-- insert_messages_sorted (nmbus.postgres.rows.insert_sql).
WITH ins AS (
    INSERT INTO {queue} ({insert_columns})
    SELECT {insert_values}
    {insert_arrays}
    ORDER BY v.ord
    RETURNING 1
)
SELECT count(*) AS inserted, pg_notify($9, $2) FROM ins;

-- insert_messages_sorted --
-- insert_messages for more than one message: the rows get their ids in array
-- order (so in send order, as insert_messages gives them), then are inserted in
-- unique_id order. Each unique_id's entry is taken (or locked: queue_unique_function)
-- as its row is inserted, so two senders of the same unique_ids in opposite
-- orders would each wait on an id the other holds (a deadlock); in one order,
-- the second waits for the first and then finds its ids taken.
WITH sent AS MATERIALIZED (
    SELECT v.*, nextval({id_seq_text}) AS id
    {insert_arrays}
    ORDER BY v.ord
), ins AS (
    INSERT INTO {queue} (id, {insert_columns})
    OVERRIDING SYSTEM VALUE
    SELECT v.id, {insert_values}
    FROM sent AS v
    ORDER BY v.unique_id, v.ord
    RETURNING 1
)
SELECT count(*) AS inserted, pg_notify($9, $2) FROM ins;

-- insert_columns --
-- Fragment of insert_messages and insert_messages_sorted: the columns a sender gives.
from_endpoint, to_endpoint, subqueue, retry_time, correlation_id, label, msg_text,
msg_headers, unique_id, priority, sequence_key, expires_at

-- insert_values --
-- Fragment of insert_messages and insert_messages_sorted: the values of
-- insert_columns for message v of the arrays (insert_arrays).
$1, $2,
CASE WHEN v.deliver_at > now() THEN 'R' ELSE 'I' END,
{parked_retry_time(table => {queue})},
v.correlation_id, v.label, v.msg_text, v.msg_headers::jsonb, v.unique_id,
v.priority, v.sequence_key, v.expires_at

-- insert_arrays --
-- Fragment of insert_messages(_sorted) and outbox_insert: the messages of their
-- arrays $3..$8 and $10..$12 (see insert_messages), one row each, with its
-- place in the arrays (ord).
FROM unnest($3::timestamptz[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[],
            $10::smallint[], $11::text[], $12::timestamptz[]) WITH ORDINALITY
     AS v(deliver_at, correlation_id, label, msg_text, msg_headers, unique_id,
          priority, sequence_key, expires_at, ord)

-- parked_retry_time --
-- Fragment of insert_messages and of nmbus_publish_v3 (create_publish_function):
-- the retry_time of a new row v of table {:table}. A member of a sequence
-- behind an earlier member of the same insert, or behind one in the table
-- not yet in X, is parked ('infinity', out of the ready index); any other row
-- is due at its deliver_at, or now.
CASE WHEN v.sequence_key IS NOT NULL AND (
         row_number() OVER (PARTITION BY v.sequence_key ORDER BY v.ord) > 1
         OR EXISTS (SELECT 1 FROM {:table} AS e
                    WHERE e.sequence_key = v.sequence_key AND e.subqueue <> 'X'))
     THEN 'infinity'::timestamptz
     ELSE greatest(coalesce(v.deliver_at, now()), now()) END
