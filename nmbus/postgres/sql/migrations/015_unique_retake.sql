-- migrate_15_unique_retake --
-- Schema version 15, per queue: the trigger function of the unique table tries
-- its insert again when the entry it found is gone before it could lock it (its
-- row deleted in between), instead of dropping the new row as a duplicate.
{queue_unique_function}
