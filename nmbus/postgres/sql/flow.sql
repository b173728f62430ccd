-- Flow control (nmbus/delivery/flow.py, nmbus/postgres/flow.py, docs/flow-control.md):
-- the claim of an endpoint whose handlers declare limits, and the flights table
-- it counts them in. A flight is one limited message claimed by one worker: it
-- counts as running while the queue row is still leased by that claim (so a
-- worker killed with SIGKILL stops counting when its lease runs out, and a
-- finish stops it at once). For a rate, it counts as a start from its claim
-- until the worker marks it, after its handler has started (flow_started, and
-- flow_finishing before the finish at the latest), and then in every window
-- that holds the mark's time. That time is never before the real start, so
-- every one-second window of real handler starts holds at most the rate,
-- whatever the delays between a claim, a start and its mark. The
-- claims of one queue with limits take a transaction-scoped advisory lock
-- (flow_lock) before they count, so two claims never both take the last room.

-- flights_table --
-- Fragment of create_schema and migrate_11_flow: the limited messages claimed,
-- one row per message, limit key (the handler) and claim; and the limits each
-- handler was last declared with (flow_declare). Named with a '$', which no
-- queue name contains.
CREATE TABLE IF NOT EXISTS {schema}."flow$flights" (
    queue text NOT NULL,
    key text NOT NULL,
    group_key text NOT NULL,
    id bigint NOT NULL,
    client text NOT NULL,
    attempt integer NOT NULL,
    claimed timestamptz NOT NULL DEFAULT clock_timestamp(),
    started timestamptz,
    CONSTRAINT "flow$flights$pkey" PRIMARY KEY (queue, key, id, attempt)
);
CREATE INDEX IF NOT EXISTS "flow$flights$claimed" ON {schema}."flow$flights" (queue, claimed);
CREATE TABLE IF NOT EXISTS {schema}."flow$limits" (
    queue text NOT NULL,
    key text NOT NULL,
    limits text NOT NULL,
    labels text[] NOT NULL,
    concurrency integer,
    starts integer,
    window_s float8,
    group_concurrency integer,
    declared_by text NOT NULL,
    declared_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT "flow$limits$pkey" PRIMARY KEY (queue, key)
);

-- flow_declare --
-- Record the limits $3[] (as text) of handlers $2[] of queue $1, as process $4
-- declares them at start, with the labels each counts ($5[]: the labels of each
-- handler joined by a newline, which no label contains) and its limits as
-- numbers ($6 concurrency[], $7 starts[] per $8 window[] seconds,
-- $9 group_concurrency[]; NULL: none); returns the handlers whose limits another
-- process recorded differently (key, limits, declared_by, declared_at), as they
-- were before.
WITH given AS (
    SELECT g.key, g.limits, string_to_array(g.labels, E'\n') AS labels,
           g.concurrency, g.starts,
           CASE WHEN g.starts IS NOT NULL THEN g.window_s END AS window_s, g.group_concurrency
    FROM unnest($2::text[], $3::text[], $5::text[], $6::int[], $7::int[], $8::float8[],
                $9::int[])
        AS g(key, limits, labels, concurrency, starts, window_s, group_concurrency)
), before AS (
    SELECT l.key, l.limits, l.declared_by, l.declared_at
    FROM {schema}."flow$limits" AS l JOIN given AS g ON g.key = l.key
    WHERE l.queue = $1 AND l.limits <> g.limits
), saved AS (
    INSERT INTO {schema}."flow$limits" AS l (queue, key, limits, labels, concurrency, starts,
                                             window_s, group_concurrency, declared_by)
    SELECT $1, key, limits, labels, concurrency, starts, window_s, group_concurrency, $4
    FROM given
    ON CONFLICT (queue, key) DO UPDATE
        SET limits = excluded.limits, labels = excluded.labels,
            concurrency = excluded.concurrency, starts = excluded.starts,
            window_s = excluded.window_s, group_concurrency = excluded.group_concurrency,
            declared_by = excluded.declared_by, declared_at = now()
    RETURNING 1
)
SELECT key, limits, declared_by, declared_at FROM before;

-- flow_lock --
-- Serialise the limited claims of one queue ($1: a number nmbus derives from the
-- schema and queue names) until the claiming transaction ends.
SELECT pg_advisory_xact_lock($1);

-- flow_started --
-- The handlers of rate-limited messages of queue $1 have started: $2 key[],
-- $3 id[], $4 attempt[] and $5 claim[] (the claim each message is leased under)
-- name their flights. Run after each handler has started (never before: the
-- time it records must not precede the real start); a flight already marked
-- keeps its time.
UPDATE {schema}."flow$flights" AS f SET started = clock_timestamp()
FROM unnest($2::text[], $3::bigint[], $4::int[], $5::text[]) AS s(key, id, attempt, claim)
WHERE f.queue = $1 AND f.key = s.key AND f.id = s.id AND f.attempt = s.attempt
  AND f.client = s.claim AND f.started IS NULL;

-- flow_finishing --
-- Messages $4[] of queue $1 taken by claim $2 whose handlers ran are about to
-- be finished: every flight of theirs under keys $3[] not marked yet (its mark
-- still on its way) is marked now, before the finish ends its lease and with it
-- its count as a start that runs.
UPDATE {schema}."flow$flights" SET started = clock_timestamp()
WHERE queue = $1 AND key = ANY ($3::text[]) AND id = ANY ($4::bigint[])
  AND client = $2 AND started IS NULL;

-- flow_waiting --
-- After a limited claim that took less than it asked for: `waiting`, whether
-- queue table rows of labels $1[] are ready now (I, or R that is due) at or
-- above the ready floor $2, held back by a limit, so the loop claims again soon
-- rather than at its next poll; `next_room`, in seconds, when the oldest start
-- still in a rate window of queue $3 leaves it ($4 key[], $5 window[] of the
-- keys with a rate), the soonest a rate can have room again (NULL: none full).
SELECT EXISTS (
           SELECT 1 FROM {queue}
           WHERE subqueue IN ('I', 'R') AND retry_time <= now() AND retry_time < 'infinity'
             AND (lease_expires IS NULL OR lease_expires < now())
             AND id >= $2 AND label = ANY ($1::text[])) AS waiting,
       (SELECT extract(epoch FROM min(f.started + make_interval(secs => w.window_s)) - now())
        FROM {schema}."flow$flights" AS f
        JOIN unnest($4::text[], $5::float8[]) AS w(key, window_s) ON w.key = f.key
        WHERE f.queue = $3 AND f.started > now() - make_interval(secs => w.window_s))::float8
           AS next_room;

-- flow_claim --
-- Claim up to $1 ready rows as claim $2 with a lease of $3 seconds at or above
-- the ready floor $4, as claim does, within the limits of queue $5's handlers:
-- $6 label[] and $7 key[] pair each label with a limit it counts against (the
-- handler's name); per key, $8 key[], $9 concurrency[] (most running at once),
-- $10 starts[] and $11 window[] (most starts in any window of that many
-- seconds), $12 group_concurrency[] (most running at once per group), NULL for
-- no such limit. $13: how many ready rows to look at (a few batches: rows held
-- back by a group limit are passed over within them). $14: seconds after which a
-- flight that no longer runs is deleted (a claimed message not marked as started
-- counts as a start while its claim lasts). $15: the most messages of one
-- concurrency-limited handler one claim takes (what the claiming loop runs at
-- once), so that the room of a limit goes to loops that run it, not to one
-- batch that would run them one after another. Rows whose labels have no room at all,
-- or whose group has none, are skipped by the scan itself, so other types and
-- groups flow past a backlog that is held back. Run after flow_lock, in its
-- transaction: the counts then see every claim committed before.
WITH limits AS (
    SELECT * FROM unnest($8::text[], $9::int[], $10::int[], $11::float8[], $12::int[])
        AS l(key, concurrency, starts, window_s, group_concurrency)
), kinds AS (
    SELECT * FROM unnest($6::text[], $7::text[]) AS k(label, key)
), flown AS (
    SELECT f.key, f.group_key, f.started,
           EXISTS (SELECT 1 FROM {queue} AS q
                   WHERE q.id = f.id AND q.id >= $4 AND q.handling_client_id = f.client
                     AND q.retry_count = f.attempt AND q.subqueue IN ('I', 'R')
                     AND q.lease_expires > now()) AS running
    FROM {schema}."flow$flights" AS f
    WHERE f.queue = $5 AND f.key = ANY ($8::text[])
), room_used AS (
    SELECT l.key, l.group_concurrency,
           least(coalesce(l.concurrency - count(*) FILTER (WHERE f.running), 2147483647),
                 coalesce(l.starts - count(*) FILTER (
                     WHERE (f.started IS NULL AND f.running)
                        OR f.started > now() - make_interval(secs => l.window_s)),
                     2147483647))
               AS free
    FROM limits AS l LEFT JOIN flown AS f ON f.key = l.key
    GROUP BY l.key, l.concurrency, l.starts, l.window_s, l.group_concurrency
), room AS (
    SELECT u.key, u.group_concurrency, u.free,
           CASE WHEN l.concurrency IS NULL THEN u.free ELSE least(u.free, $15) END AS cap,
           ARRAY(SELECT k.label FROM kinds AS k WHERE k.key = u.key) AS labels
    FROM room_used AS u JOIN limits AS l ON l.key = u.key
), group_running AS (
    SELECT f.key, f.group_key, count(*) AS running
    FROM flown AS f WHERE f.running GROUP BY f.key, f.group_key
), held AS (
    SELECT k.label, NULL::text AS group_key
    FROM kinds AS k JOIN room AS r ON r.key = k.key WHERE r.free <= 0
    UNION
    SELECT k.label, g.group_key
    FROM kinds AS k JOIN room AS r ON r.key = k.key
    JOIN group_running AS g ON g.key = k.key
    WHERE g.running >= r.group_concurrency AND g.group_key <> ''
), candidates AS NOT MATERIALIZED (
    SELECT r.id, r.label, coalesce(r.msg_headers ->> 'nmbus-group', '') AS group_key,
           string_to_array(r.msg_headers ->> 'nmbus-type-chain', ',') AS chain,
           r.priority, r.retry_time,
           CASE WHEN r.lease_expires IS NULL THEN 0
                WHEN r.handling_client_id IS NULL THEN 1
                WHEN r.isolated THEN 3
                ELSE 2 END AS recovered
    FROM {queue} AS r
    WHERE r.subqueue IN ('I', 'R') AND r.retry_time <= now() AND r.retry_time < 'infinity'
      AND (r.lease_expires IS NULL OR r.lease_expires < now())
      AND r.id >= $4
      AND {sequence_head(floor => $4, filter => '')}
), free_rows AS (
    SELECT c.* FROM candidates AS c
    WHERE coalesce(c.label, '') <> ALL ($6::text[])
      AND NOT coalesce(c.chain && $6::text[], false)
    ORDER BY c.priority DESC, c.retry_time, c.id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
), limited_rows AS (
    SELECT DISTINCT ON (t.id) t.*
    FROM room AS rm
    CROSS JOIN LATERAL (
        SELECT c.* FROM candidates AS c
        WHERE (c.label = ANY (rm.labels) OR coalesce(c.chain && rm.labels, false))
          AND coalesce(c.label, '') <> ALL (ARRAY(SELECT label FROM held WHERE group_key IS NULL))
          AND NOT coalesce(c.chain && ARRAY(SELECT label FROM held WHERE group_key IS NULL), false)
          AND (coalesce(c.label, ''), c.group_key) NOT IN (
              SELECT label, group_key FROM held WHERE group_key IS NOT NULL)
        ORDER BY c.priority DESC, c.retry_time, c.id
        LIMIT least(rm.cap, $13)
        FOR UPDATE SKIP LOCKED
    ) AS t
    WHERE rm.free > 0
), pool AS (
    SELECT * FROM free_rows
    UNION ALL
    SELECT * FROM limited_rows WHERE id NOT IN (SELECT id FROM free_rows)
), ranked AS (
    SELECT p.id, r.group_concurrency, coalesce(g.running, 0) AS group_running,
           r.cap AS free, p.group_key,
           row_number() OVER (PARTITION BY k.key
                              ORDER BY p.priority DESC, p.retry_time, p.id) AS nth,
           row_number() OVER (PARTITION BY k.key, p.group_key
                              ORDER BY p.priority DESC, p.retry_time, p.id) AS nth_in_group
    FROM pool AS p
    JOIN kinds AS k ON k.label = p.label OR k.label = ANY (p.chain)
    JOIN room AS r ON r.key = k.key
    LEFT JOIN group_running AS g ON g.key = k.key AND g.group_key = p.group_key
), refused AS (
    SELECT DISTINCT id FROM ranked
    WHERE nth > free
       OR (group_concurrency IS NOT NULL AND group_key <> ''
           AND nth_in_group > group_concurrency - group_running)
), ready AS (
    SELECT p.id, p.recovered, p.label, p.chain, p.group_key
    FROM pool AS p
    WHERE p.id NOT IN (SELECT id FROM refused)
    ORDER BY p.priority DESC, p.retry_time, p.id
    LIMIT $1
), claimed AS (
    {claim_lease(client => $2, lease => $3, floor => $4)}
), flights AS (
    INSERT INTO {schema}."flow$flights" (queue, key, group_key, id, client, attempt)
    SELECT DISTINCT $5, k.key, rd.group_key, c.id, $2, c.retry_count
    FROM claimed AS c JOIN ready AS rd ON rd.id = c.id
    JOIN kinds AS k ON k.label = rd.label OR k.label = ANY (rd.chain)
    ON CONFLICT (queue, key, id, attempt) DO UPDATE
        SET client = excluded.client, claimed = clock_timestamp(), started = NULL,
            group_key = excluded.group_key
    RETURNING 1
), gone AS (
    DELETE FROM {schema}."flow$flights" AS d
    WHERE d.queue = $5 AND coalesce(d.started, d.claimed) < now() - make_interval(secs => $14)
      AND NOT EXISTS (SELECT 1 FROM {queue} AS q
                      WHERE q.id = d.id AND q.handling_client_id = d.client
                        AND q.retry_count = d.attempt AND q.subqueue IN ('I', 'R')
                        AND q.lease_expires > now())
    RETURNING 1
)
SELECT * FROM claimed;

-- flow_status --
-- Each handler of queue $1 with limits, as last declared (flow_declare): its
-- limits, who declared them and when; its messages in flight (still leased by
-- the claim that took them); its starts in its rate's window (NULL: no rate);
-- the ready messages of its types no worker holds (`waiting`); and of those,
-- the ones its limits hold back now (`held_back`): all of them while it has no
-- room, else those of the groups at its group_concurrency. Counts the ready
-- rows of limited types once (the ready index), read-only.
WITH lim AS (
    SELECT l.key, l.limits, l.labels, l.concurrency, l.starts, l.window_s,
           l.group_concurrency, l.declared_by, l.declared_at
    FROM {schema}."flow$limits" AS l WHERE l.queue = $1
), flown AS (
    SELECT f.key, f.group_key, f.started,
           EXISTS (SELECT 1 FROM {queue} AS q
                   WHERE q.id = f.id AND q.handling_client_id = f.client
                     AND q.retry_count = f.attempt AND q.subqueue IN ('I', 'R')
                     AND q.lease_expires > now()) AS running
    FROM {schema}."flow$flights" AS f WHERE f.queue = $1
), waiting AS (
    SELECT r.label, coalesce(r.msg_headers ->> 'nmbus-group', '') AS group_key, count(*) AS n
    FROM {queue} AS r
    WHERE r.subqueue IN ('I', 'R') AND r.retry_time <= now() AND r.retry_time < 'infinity'
      AND (r.lease_expires IS NULL OR r.lease_expires < now())
      AND r.label IN (SELECT unnest(labels) FROM lim)
    GROUP BY 1, 2
), counted AS (
    SELECT l.*,
           (SELECT count(*) FROM flown AS f WHERE f.key = l.key AND f.running) AS in_flight,
           CASE WHEN l.starts IS NOT NULL THEN
               (SELECT count(*) FROM flown AS f
                WHERE f.key = l.key
                  AND ((f.started IS NULL AND f.running)
                       OR f.started > now() - make_interval(secs => l.window_s)))
           END AS started,
           coalesce((SELECT sum(w.n) FROM waiting AS w WHERE w.label = ANY (l.labels)), 0)
               AS waiting,
           coalesce((SELECT sum(w.n) FROM waiting AS w
                     WHERE w.label = ANY (l.labels) AND w.group_key <> ''
                       AND l.group_concurrency <= (
                           SELECT count(*) FROM flown AS f
                           WHERE f.key = l.key AND f.group_key = w.group_key AND f.running)),
                    0) AS group_held
    FROM lim AS l
)
SELECT key, limits, declared_by, declared_at, in_flight, started, waiting,
       CASE WHEN in_flight >= concurrency OR started >= starts THEN waiting
            ELSE group_held END::bigint AS held_back
FROM counted
ORDER BY key;

-- flow_limited_queues --
-- The queues whose handlers have declared limits, by name.
SELECT DISTINCT queue FROM {schema}."flow$limits" ORDER BY queue;
