-- The SQL of nmbus demo: the shop's payments, in the demo's own schema, by name.
--
-- The same format as nmbus/postgres/sql/*.sql, read by the same loader
-- (nmbus.postgres.sql.load) and filled in by the same nmbus.postgres.sql.fill:
-- {schema} is the quoted schema, {queue} the quoted schema-qualified queue
-- table. The library core never reads this file.

-- demo_drop_schema --
-- Drop the demo's schema with everything in it (checked to exist and to be the demo's).
DROP SCHEMA {schema} CASCADE;

-- demo_schema_exists --
-- Whether schema $1 (unquoted) exists.
SELECT to_regnamespace(quote_ident($1::text)) IS NOT NULL;

-- demo_is_demo_schema --
-- Whether schema $1 (unquoted) is absent or was made by the demo (has demo_payments).
SELECT to_regnamespace(quote_ident($1::text)) IS NULL
    OR to_regclass(format('%I.demo_payments', $1::text)) IS NOT NULL;

-- demo_create_tables --
-- Create the demo schema and the table billing writes in its handler's transaction.
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {schema}.demo_payments (
    order_id bigint PRIMARY KEY,
    amount numeric(12, 2) NOT NULL,
    paid_at timestamptz NOT NULL DEFAULT now()
);

-- demo_insert_payment --
-- Record the payment of order $1 for amount $2 (once, whatever the retries).
INSERT INTO {schema}.demo_payments (order_id, amount) VALUES ($1, $2)
ON CONFLICT (order_id) DO NOTHING;

-- demo_count_payments --
-- How many payments are recorded.
SELECT count(*) FROM {schema}.demo_payments;

-- demo_retried_count --
-- Messages of a queue that needed more than one attempt.
SELECT count(*) FROM {queue} WHERE retry_count > 1;

-- demo_top_errors --
-- The $1 most frequent first lines of error_info in a queue, with their counts.
SELECT split_part(error_info, E'\n', 1) AS error, count(*) AS n
FROM {queue} WHERE error_info IS NOT NULL
GROUP BY 1 ORDER BY n DESC, error LIMIT $1;
