-- Add one message to a queue with a plain INSERT, and wake the workers.
--   psql "$NMBUS_DSN" -v queue=billing -v type=billing.ChargeCard \
--        -v body='{"order_id": 42}' -f sql/cookbook/inject_message.sql
-- type is the message's type name (Message type_name), body its JSON; optionally
-- -v from=NAME for from_endpoint (default psql). Every other column takes its
-- default: subqueue I, ready now, no attempts yet, and a fresh unique_id. To make
-- a re-run store the message once, give unique_id yourself and add
-- ON CONFLICT (unique_id) DO NOTHING. NOTIFY uses the channel the workers listen
-- on (nmbus_<schema>) with the queue as payload.

\if :{?schema}
\else
  \set schema nmbus
\endif
\if :{?queue}
\else
  \warn 'set the queue: psql -v queue=NAME ...'
  \quit
\endif
\if :{?type}
\else
  \warn 'set the type: psql -v type=TYPE_NAME ...'
  \quit
\endif
\if :{?body}
\else
  \warn 'set the body: psql -v body=JSON ...'
  \quit
\endif
\if :{?from}
\else
  \set from psql
\endif

WITH added AS (
    INSERT INTO :"schema".:"queue" (from_endpoint, to_endpoint, label, msg_text)
    VALUES (:'from', :'queue', :'type', :'body')
    RETURNING id, unique_id
)
SELECT id, unique_id,
       pg_notify('nmbus_' || :'schema', :'queue') IS NOT NULL AS notified
FROM added;
