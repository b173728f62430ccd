-- Publish/subscribe (docs/pubsub.md): the subscriptions, and the fan-out, which
-- runs on the server: one call finds the live subscribers and stores a copy in
-- each one's queue table.

-- subscribe --
-- Add or renew subscriptions of subscriber $2 to publisher $1 for types $3,
-- expiring $4 seconds from now (NULL: never). $5: the subscriber lives in
-- another database (its copies go through the outbox).
INSERT INTO {schema}.subscriptions AS s
    (publisher_endpoint, subscriber_endpoint, message_type, created_date, expiration_date,
     subscriber_remote)
SELECT $1, $2, t, now(),
       CASE WHEN $4::float8 IS NULL THEN NULL ELSE now() + make_interval(secs => $4::float8) END,
       $5
FROM unnest($3::text[]) AS t
ON CONFLICT (publisher_endpoint, message_type, subscriber_endpoint)
DO UPDATE SET expiration_date = EXCLUDED.expiration_date,
              subscriber_remote = EXCLUDED.subscriber_remote;

-- unsubscribe --
-- Remove subscriptions of subscriber $2 to publisher $1 for types $3.
DELETE FROM {schema}.subscriptions
WHERE publisher_endpoint = $1 AND subscriber_endpoint = $2 AND message_type = ANY($3::text[]);

-- subscribers --
-- Live subscribers of publisher $1 for any of the type names $2.
SELECT DISTINCT subscriber_endpoint FROM {schema}.subscriptions
WHERE publisher_endpoint = $1 AND message_type = ANY($2::text[])
  AND (expiration_date IS NULL OR expiration_date > now())
ORDER BY subscriber_endpoint;

-- publish_function_exists --
-- Whether the fan-out function of this version is installed. $1: schema name (unquoted).
SELECT to_regprocedure(format(
    '%I.nmbus_publish_v3(text,text,text[],text[],text[],text[],text[],text[],timestamptz[],text,smallint[],text[],timestamptz[],text[],text)',
    $1::text)) IS NOT NULL;

-- create_publish_function --
-- Install nmbus_publish_v3 (the version is in its name, so processes of an older
-- nmbus keep calling the function they know: v1 had no priority, sequence or
-- expiry, v2 no routes). Per message it takes its type chain ("a.Sub,a.Base", most specific
-- first), label, body, headers (JSON text), correlation id, publish id, delivery
-- time, priority, sequence key and expiry; copies go into each subscriber's table
-- in array order, so a sequence keeps its order in every subscriber's queue.
-- Each copy's unique_id is
-- "<publish id>/<subscriber>", so a re-published id is stored once per queue.
-- A subscriber named in $14 (the caller's routes) or whose subscription says it
-- lives in another database gets its copies in the outbox instead, woken on
-- channel $15, for the forwarder to move (docs/routes.md).
-- Returns one row per live subscriber: (subscriber, copies inserted, missing).
-- If any subscriber's queue table is missing it inserts nothing and returns only
-- the missing ones (missing = true), so the caller can create them in its own
-- transaction and call again. Wakes each subscriber with one NOTIFY.
CREATE OR REPLACE FUNCTION {schema}.nmbus_publish_v3(
    p_schema text, p_publisher text, p_chains text[], p_labels text[], p_texts text[],
    p_headers text[], p_correlations text[], p_publish_ids text[],
    p_deliver_at timestamptz[], p_channel text, p_priorities smallint[],
    p_sequences text[], p_expires timestamptz[], p_routed text[], p_outbox_channel text
) RETURNS TABLE (subscriber text, inserted bigint, missing boolean)
LANGUAGE plpgsql AS $fn$
#variable_conflict use_column
DECLARE
    v_types text[];
    v_subs text[];
    v_sub_types text[];
    v_remote boolean[];
    v_absent text[];
    i integer;
BEGIN
    SELECT array_agg(DISTINCT t) INTO v_types
    FROM unnest(p_chains) AS c(chain), unnest(string_to_array(c.chain, ',')) AS t;
    SELECT array_agg(s.sub ORDER BY s.sub), array_agg(s.types ORDER BY s.sub),
           array_agg(s.remote OR s.sub = ANY (coalesce(p_routed, ARRAY[]::text[])) ORDER BY s.sub)
    INTO v_subs, v_sub_types, v_remote
    FROM (
        SELECT subscriber_endpoint AS sub, string_agg(message_type, ',') AS types,
               bool_or(subscriber_remote) AS remote
        FROM {schema}.subscriptions
        WHERE publisher_endpoint = p_publisher AND message_type = ANY (v_types)
          AND (expiration_date IS NULL OR expiration_date > now())
        GROUP BY subscriber_endpoint
    ) AS s;
    IF v_subs IS NULL THEN
        RETURN;
    END IF;
    SELECT array_agg(x) INTO v_absent FROM unnest(v_subs, v_remote) AS u(x, remote)
    WHERE NOT remote AND to_regclass(format('%I.%I', p_schema, x)) IS NULL;
    IF v_absent IS NOT NULL THEN
        RETURN QUERY SELECT x, 0::bigint, true FROM unnest(v_absent) AS x;
        RETURN;
    END IF;
    FOR i IN 1 .. array_length(v_subs, 1) LOOP
        subscriber := v_subs[i];
        missing := false;
        IF v_remote[i] THEN
            EXECUTE format($q$
                WITH ins AS (
                    INSERT INTO %1$I.outbox (to_endpoint, from_endpoint, deliver_at,
                                             correlation_id, label, msg_text, msg_headers,
                                             unique_id, priority, sequence_key, expires_at)
                    SELECT $2, $1, v.deliver_at, v.correlation_id, v.label, v.msg_text,
                           v.msg_headers::jsonb, v.publish_id || '/' || $2,
                           coalesce(v.priority, 0), v.sequence_key, v.expires_at
                    {published_rows}
                    ON CONFLICT (to_endpoint, unique_id) DO NOTHING
                    RETURNING 1
                )
                SELECT count(*) FROM ins
            $q$, p_schema)
            INTO inserted
            USING p_publisher, subscriber, p_chains, p_labels, p_texts, p_headers,
                  p_correlations, p_publish_ids, p_deliver_at,
                  string_to_array(v_sub_types[i], ','), p_priorities, p_sequences, p_expires;
            IF inserted > 0 THEN
                PERFORM pg_notify(p_outbox_channel, subscriber);
            END IF;
            RETURN NEXT;
            CONTINUE;
        END IF;
        EXECUTE format($q$
            WITH ins AS (
                INSERT INTO %1$I.%2$I ({insert_columns})
                SELECT $1, $2,
                       CASE WHEN v.deliver_at > now() THEN 'R' ELSE 'I' END,
                       {parked_retry_time(table => %1$I.%2$I)},
                       v.correlation_id, v.label, v.msg_text, v.msg_headers::jsonb,
                       v.publish_id || '/' || $2, coalesce(v.priority, 0), v.sequence_key,
                       v.expires_at
                {published_rows}
                            RETURNING 1
            )
            SELECT count(*) FROM ins
        $q$, p_schema, subscriber)
        INTO inserted
        USING p_publisher, subscriber, p_chains, p_labels, p_texts, p_headers,
              p_correlations, p_publish_ids, p_deliver_at,
              string_to_array(v_sub_types[i], ','), p_priorities, p_sequences, p_expires;
        IF inserted > 0 THEN
            PERFORM pg_notify(p_channel, subscriber);
        END IF;
        missing := false;
        RETURN NEXT;
    END LOOP;
END
$fn$;

-- published_rows --
-- Fragment of nmbus_publish_v3 (create_publish_function), in the statement it
-- runs for one subscriber, whether its copies go to its queue table or to the
-- outbox: the messages whose type chain holds a type it subscribed to ($10),
-- in the order they were published.
FROM unnest($3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
            $8::text[], $9::timestamptz[], $11::smallint[], $12::text[],
            $13::timestamptz[]) WITH ORDINALITY
     AS v(chain, label, msg_text, msg_headers, correlation_id, publish_id,
          deliver_at, priority, sequence_key, expires_at, ord)
WHERE string_to_array(v.chain, ',') && $10::text[]
ORDER BY v.ord

-- publish --
-- Fan messages out to every live subscriber of publisher $2 (see
-- create_publish_function for $1..$15). One row per subscriber.
SELECT subscriber, inserted, missing
FROM {schema}.nmbus_publish_v3($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13,
                               $14, $15);

-- purge_expired_subscriptions --
-- Delete subscriptions that expired more than $1 seconds ago (their subscriber is gone).
DELETE FROM {schema}.subscriptions
WHERE expiration_date < now() - make_interval(secs => $1::float8);
