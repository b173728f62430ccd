-- migrate_unique_function --
-- Per queue: the trigger function of the unique table, as queue_unique_function
-- writes it. Schema version 14 runs it after adding the window columns; schema
-- version 15 runs it again, for the function that tries its insert again when
-- the entry it found is gone before it could lock it (its row deleted in
-- between), instead of dropping the new row as a duplicate.
{queue_unique_function}
