-- migrate_11_flow --
-- Schema version 11 (docs/flow-control.md): the flights table of flow control.
{flights_table}

-- migrate_11_group_index --
-- Schema version 11, per queue: the index of grouped ready rows (claim_fair).
-- Built under a SHARE lock on the queue table: sends wait while it reads the
-- table once (the index itself holds only grouped ready rows: none, before 11).
{queue_group_index}
