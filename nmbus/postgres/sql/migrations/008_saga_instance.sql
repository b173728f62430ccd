-- migrate_8_saga_instance --
-- Schema version 8 (docs/sagas.md): every saga table ("<endpoint>$saga") gets the
-- instance column, so that a timeout acts only on the saga instance that set it.
-- Nullable and without a default: catalog-only, no table rewrite. Rows already
-- there get their instance at their next save; a timeout sent before the upgrade
-- carries none and is handled as before.
DO $migrate$
DECLARE
    v_nsp oid := (SELECT typnamespace FROM pg_type WHERE oid = pg_typeof(NULL::{schema}.queues));
    v_schema name := (SELECT nspname FROM pg_namespace WHERE oid = v_nsp);
    t record;
BEGIN
    FOR t IN
        SELECT c.relname FROM pg_class AS c
        WHERE c.relnamespace = v_nsp AND c.relkind = 'r' AND c.relname LIKE '%$saga'
          AND EXISTS (SELECT 1 FROM pg_attribute AS a
                      WHERE a.attrelid = c.oid AND a.attname = 'saga_key' AND NOT a.attisdropped)
    LOOP
        EXECUTE format('ALTER TABLE %I.%I ADD COLUMN IF NOT EXISTS instance uuid',
                       v_schema, t.relname);
    END LOOP;
END
$migrate$;
