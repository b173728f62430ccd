-- migrate_13_drop_held --
-- Schema version 13, per queue: the records of held batches go (the setting
-- held_batches was removed; every claim leases its rows). A worker of an older
-- nmbus that still holds a batch keeps its rows locked in its own transaction;
-- DROP waits for it to end, as for any lock on the table.
DROP TABLE IF EXISTS {held};
