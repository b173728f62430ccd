-- migrate_10_function --
-- Schema version 10: the function that creates a segment of a queue table.
{segment_function}

-- migrate_10_segments --
-- Schema version 10 (docs/storage.md, "Segments"), per queue table: the table
-- becomes segment 0 of a new partitioned table of the same name, and no row is
-- rewritten. Under an ACCESS EXCLUSIVE lock on the queue table, held until the
-- migration commits: a CHECK on its ids is validated (one scan of the primary
-- key's column, about 0.15 s per million rows), its identity and unique index
-- are dropped and its other objects renamed (catalog only); the partitioned table
-- is created with its indexes and unique table, the unique_ids are copied into
-- that table (about 1.5 s per million rows: the one step in proportion to the
-- rows), and the old table is attached as segment 0 (its indexes are attached,
-- not rebuilt). New rows go to the segment after the highest id.
DO $migrate$
DECLARE
    v_oid oid := (SELECT typrelid FROM pg_type WHERE oid = pg_typeof(NULL::{queue})::oid);
    v_schema name;
    v_name name;
    v_kind "char";
    v_next bigint;
    v_role text;
BEGIN
    SELECT n.nspname, c.relname, c.relkind INTO v_schema, v_name, v_kind
    FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace WHERE c.oid = v_oid;
    IF v_kind <> 'r' THEN
        RETURN;
    END IF;
    EXECUTE format('LOCK TABLE %I.%I IN ACCESS EXCLUSIVE MODE', v_schema, v_name);
    EXECUTE format('SELECT coalesce(max(id), 0) FROM %I.%I', v_schema, v_name) INTO v_next;
    v_next := (v_next / 68719476736 + 1) * 68719476736;
    EXECUTE format('ALTER TABLE %I.%I ADD CONSTRAINT %I CHECK (id IS NOT NULL AND id < %s)',
                   v_schema, v_name, v_name || '$s0$bound', v_next);
    EXECUTE format('ALTER TABLE %I.%I ALTER COLUMN id DROP IDENTITY IF EXISTS',
                   v_schema, v_name);
    EXECUTE format('DROP INDEX IF EXISTS %I.%I', v_schema, v_name || '$uid');
    EXECUTE format('ALTER TABLE %I.%I RENAME CONSTRAINT %I TO %I',
                   v_schema, v_name, v_name || '$pkey', v_name || '$s0$pkey');
    -- The check of subqueue gets the name the partitioned table gives it.
    FOR v_role IN
        SELECT conname FROM pg_constraint
        WHERE conrelid = v_oid AND contype = 'c' AND conname <> v_name || '$subqueue'
          AND pg_get_constraintdef(oid) LIKE 'CHECK ((subqueue = ANY%'
    LOOP
        EXECUTE format('ALTER TABLE %I.%I RENAME CONSTRAINT %I TO %I',
                       v_schema, v_name, v_role, v_name || '$subqueue');
    END LOOP;
    FOREACH v_role IN ARRAY ARRAY['ready', 'seq', 'done'] LOOP
        EXECUTE format('ALTER INDEX IF EXISTS %I.%I RENAME TO %I',
                       v_schema, v_name || '$' || v_role, v_name || '$s0$' || v_role);
    END LOOP;
    EXECUTE format('ALTER TABLE %I.%I RENAME TO %I', v_schema, v_name, v_name || '$s0');
END
$migrate$;
{create_queue}
DO $migrate$
DECLARE
    v_parent oid := (SELECT typrelid FROM pg_type WHERE oid = pg_typeof(NULL::{queue})::oid);
    v_schema name;
    v_name name;
    v_old oid;
    v_next bigint;
    v_segment bigint;
BEGIN
    SELECT n.nspname, c.relname INTO v_schema, v_name
    FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace WHERE c.oid = v_parent;
    v_old := to_regclass(format('%I.%I', v_schema, v_name || '$s0'));
    IF v_old IS NULL OR EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = v_old) THEN
        RETURN;
    END IF;
    EXECUTE format('SELECT coalesce(max(id), 0) FROM %I.%I', v_schema, v_name || '$s0')
        INTO v_next;
    v_segment := v_next / 68719476736 + 1;
    v_next := v_segment * 68719476736;
    EXECUTE format('INSERT INTO %I.%I (unique_id, id) SELECT unique_id, id FROM %I.%I',
                   v_schema, v_name || '$unique', v_schema, v_name || '$s0');
    EXECUTE format('ALTER TABLE %I.%I ATTACH PARTITION %I.%I FOR VALUES FROM (MINVALUE) TO (%s)',
                   v_schema, v_name, v_schema, v_name || '$s0', v_next);
    EXECUTE format('ALTER TABLE %I.%I DROP CONSTRAINT %I',
                   v_schema, v_name || '$s0', v_name || '$s0$bound');
    PERFORM setval(pg_get_serial_sequence(format('%I.%I', v_schema, v_name), 'id'), v_next, false);
    -- create_queue left segment 0 to the old table (the name was taken) and made
    -- segment 1; new rows start in the segment after the old ids (1, unless a
    -- queue ever handed out 2^36 ids, where attaching fails and nothing changes).
    PERFORM {schema}.nmbus_create_segment(v_schema, v_name, v_segment);
    PERFORM {schema}.nmbus_create_segment(v_schema, v_name, v_segment + 1);
    -- The mark of a queue a send created belongs to the queue table.
    EXECUTE format('COMMENT ON TABLE %I.%I IS %L', v_schema, v_name,
                   obj_description(v_old, 'pg_class'));
    EXECUTE format('COMMENT ON TABLE %I.%I IS NULL', v_schema, v_name || '$s0');
END
$migrate$;

-- migrate_10_publish --
-- Schema version 10: the publish function inserts copies without naming the
-- unique index a segmented queue no longer has (the unique table's trigger
-- skips a copy already stored).
{create_publish_function}
