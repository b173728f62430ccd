-- migrate_14_unique_windows --
-- Schema version 14, per queue: the unique table's entries get the window of
-- their unique_id (until, pending: NULL for every entry made before, which keeps
-- them as they were); migrate_unique_function (015_unique_retake.sql) then
-- writes the trigger function that honours them.
ALTER TABLE {unique_table} ADD COLUMN IF NOT EXISTS until timestamptz,
    ADD COLUMN IF NOT EXISTS pending boolean;
