-- migrate_9_periodic_due --
-- Schema version 9 (docs/delivery.md, periodic messages): the latest due time
-- enqueued per endpoint and schedule, which retention never removes, so a tick
-- runs once per due time even after retention removed its row. Named with a '$',
-- which no queue name contains, so no queue can already hold the name.
{periodic_due_table}
