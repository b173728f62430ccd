-- migrate_12_held --
-- Schema version 12 made, per queue, the records of held batches, which
-- version 13 drops again (migrate_13_drop_held): an upgrade from an older
-- version makes none on its way.
SELECT 1;
