-- migrate_12_held --
-- Schema version 12, per queue: the records of held batches (queue_held_table).
{queue_held_table}
