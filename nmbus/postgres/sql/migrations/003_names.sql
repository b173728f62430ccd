-- migrate_3_names --
-- Schema version 3: nmbus's own objects are renamed from "<table>_<role>", which a
-- queue could take ("orders_uid" left "orders" without its unique index), to
-- "<table>$<role>": the primary keys of the shared tables and, for every queue
-- table, its primary key, identity sequence and ready/uid indexes. Objects are
-- found through the catalog by the table they belong to, so a queue table named
-- like another queue's old index is never touched. Renames are catalog-only.
DO $migrate$
DECLARE
    v_nsp oid := (SELECT typnamespace FROM pg_type WHERE oid = pg_typeof(NULL::{schema}.queues));
    v_schema name := (SELECT nspname FROM pg_namespace WHERE oid = v_nsp);
    t record;
    o record;
BEGIN
    FOR t IN
        SELECT c.oid, c.relname FROM pg_class AS c
        WHERE c.relnamespace = v_nsp AND c.relkind IN ('r', 'p')
          AND (c.relname IN ('schema_version', 'queues', 'subscriptions')
               OR c.relname IN (SELECT name FROM {schema}.queues))
    LOOP
        FOR o IN
            SELECT conname AS old, 'pkey' AS role, 'CONSTRAINT' AS kind
            FROM pg_constraint WHERE conrelid = t.oid AND contype = 'p'
            UNION ALL
            SELECT s.relname, 'id_seq', 'SEQUENCE'
            FROM pg_depend AS d JOIN pg_class AS s ON s.oid = d.objid
            WHERE d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_class'::regclass
              AND d.refobjid = t.oid AND d.deptype = 'i' AND s.relkind = 'S'
            UNION ALL
            SELECT i.relname, substr(i.relname, length(t.relname) + 2), 'INDEX'
            FROM pg_index AS x JOIN pg_class AS i ON i.oid = x.indexrelid
            WHERE x.indrelid = t.oid AND NOT x.indisprimary
              AND i.relname IN (t.relname || '_ready', t.relname || '_uid')
        LOOP
            CONTINUE WHEN o.old = t.relname || '$' || o.role;
            IF o.kind = 'CONSTRAINT' THEN
                EXECUTE format('ALTER TABLE %I.%I RENAME CONSTRAINT %I TO %I',
                               v_schema, t.relname, o.old, t.relname || '$' || o.role);
            ELSE
                EXECUTE format('ALTER %s %I.%I RENAME TO %I',
                               o.kind, v_schema, o.old, t.relname || '$' || o.role);
            END IF;
        END LOOP;
    END LOOP;
END
$migrate$;

-- migrate_3_queue --
-- Schema version 3, per queue table, after migrate_3_names: unique_id gets a
-- default, so an operator can add a message with a plain INSERT (catalog-only);
-- and the indexes a name collision kept from being created under version 2 are
-- built (a queue "ship_ready" created first left "ship" without its ready index).
ALTER TABLE {queue} ALTER COLUMN unique_id SET DEFAULT gen_random_uuid()::text;
CREATE INDEX IF NOT EXISTS {ready_index} ON {queue} (retry_time, id)
    WHERE subqueue IN ('I', 'R');
{queue_unique_index}
