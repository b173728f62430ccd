-- The claim check (docs/messages.md): a body over claim_check_bytes is stored
-- apart, in the schema's payloads table (in the message's own transaction) or
-- in a file of an fsspec store whose URL the payload's row keeps; the queue row
-- keeps the key in its header nmbus-claim-check (nmbus/postgres/claimcheck.py).

-- payloads_table --
-- Fragment of create_schema and migrate_16_claim_check: the payloads stored
-- apart, by queue and key. body holds the payload, or is NULL when it is in the
-- file at url. A payload goes when no row of its queue refers to it any more
-- (claim_check_sweep, run by retention).
CREATE TABLE IF NOT EXISTS {schema}."claim$payloads" (
    queue text NOT NULL,
    key text NOT NULL,
    body text,
    url text,
    bytes bigint NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT "claim$payloads$pkey" PRIMARY KEY (queue, key)
);

-- claim_check_key --
-- Fragment of insert_messages_apart: the payload key a new row refers to.
msg_headers ->> 'nmbus-claim-check'

-- insert_messages_apart --
-- insert_messages (insert.sql) for messages some of whose bodies are stored
-- apart: the same rows ($1..$12, the body of such a row NULL), and in the same statement the
-- payloads of the rows actually inserted (a row whose unique_id is already
-- stored is dropped, and its payload with it): $13 key[], $14 body[] (NULL when
-- in a store), $15 url[] (the store's file, or NULL), $16 bytes[].
-- The rows get their ids in send order and are inserted in unique_id order, as
-- insert_messages_sorted does: two senders of the same unique_ids in opposite
-- orders cannot deadlock. Returns how many rows were inserted.
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
    RETURNING {claim_check_key}
), payloads AS (
    INSERT INTO {schema}."claim$payloads" (queue, key, body, url, bytes)
    SELECT $2, p.key, p.body, p.url, p.bytes
    FROM unnest($13::text[], $14::text[], $15::text[], $16::bigint[]) AS p(key, body, url, bytes)
    WHERE p.key IN (SELECT * FROM ins)
)
SELECT count(*) AS inserted, pg_notify($9, $2) FROM ins;

-- claim_check_payloads --
-- The payloads of keys $2 of queue $1: body, or the url of its file.
SELECT key, body, url FROM {schema}."claim$payloads" WHERE queue = $1 AND key = ANY ($2::text[]);

-- claim_check_any --
-- Whether queue $1 has any payload stored apart (one probe of the primary key).
SELECT EXISTS (SELECT 1 FROM {schema}."claim$payloads" WHERE queue = $1);

-- claim_check_sweep --
-- Delete the payloads of queue $1 that no row of its table refers to any more:
-- their message went (a dropped segment, a deleted row). A payload and its row
-- commit together, so this statement's one snapshot sees both or neither.
-- Returns the url of each payload that was in a store, for its file to go too.
DELETE FROM {schema}."claim$payloads" AS p
WHERE p.queue = $1
  AND NOT EXISTS (SELECT 1 FROM {queue} AS q
                  WHERE q.msg_headers ? 'nmbus-claim-check'
                    AND q.msg_headers ->> 'nmbus-claim-check' = p.key)
RETURNING p.url;

-- claim_check_unknown --
-- Which of keys $2 (files found in the store of queue $1) no payload row knows:
-- orphans of a sender that died between the file's write and its commit.
SELECT k FROM unnest($2::text[]) AS k
WHERE NOT EXISTS (SELECT 1 FROM {schema}."claim$payloads" AS p WHERE p.queue = $1 AND p.key = k);

-- claim_check_forget_queue --
-- Delete every payload of queue $1 (its table is dropped).
DELETE FROM {schema}."claim$payloads" WHERE queue = $1 RETURNING url;
