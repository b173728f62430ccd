-- Subscriptions per publisher: how many are live and expired, and who listens.
--   psql "$NMBUS_DSN" -f sql/cookbook/subscriptions.sql
\if :{?schema}
\else
  \set schema nmbus
\endif

SELECT publisher_endpoint AS publisher,
       count(*) FILTER (WHERE expiration_date IS NULL OR expiration_date > now()) AS live,
       count(*) FILTER (WHERE expiration_date <= now()) AS expired,
       count(DISTINCT message_type) AS message_types,
       string_agg(DISTINCT subscriber_endpoint, ', ' ORDER BY subscriber_endpoint)
           FILTER (WHERE expiration_date IS NULL OR expiration_date > now()) AS live_subscribers
FROM :"schema".subscriptions
GROUP BY publisher_endpoint
ORDER BY publisher_endpoint;
