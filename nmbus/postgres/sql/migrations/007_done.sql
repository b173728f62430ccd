-- migrate_7_done --
-- Schema version 7 (docs/dashboard.md): the done index holds the X and F rows by
-- when they were processed, so the operations layer reads the last minutes of a
-- queue, and its failed rows, without scanning every processed row. The finish
-- that moves a row to X or F changes indexed columns already (it is never a HOT
-- update), so this adds one index entry to it. Built while the queue table is
-- locked against writes, like any CREATE INDEX: on a queue of millions of X rows
-- it takes as long as that (see docs/dashboard.md, "Upgrading").
{queue_done_index}
