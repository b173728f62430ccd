-- migrate_5_delivery --
-- Schema version 5 (docs/delivery.md): priority, ordered sequences and expiry.
-- The three columns are catalog-only (constant defaults, no table rewrite). The
-- ready index gains priority as its first key, so the claim still reads it in
-- order; it is rebuilt under the name it had (this locks the queue table while it
-- builds: a queue of many I/R rows takes as long as CREATE INDEX on them). Rows
-- with retry_time 'infinity' (never due: a sequence member parked behind an
-- earlier one, or written so by hand) are left out of it. The sequence index
-- holds only members of a sequence not yet in X.
ALTER TABLE {queue}
    ADD COLUMN IF NOT EXISTS priority smallint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS sequence_key text,
    ADD COLUMN IF NOT EXISTS expires_at timestamptz;
DROP INDEX IF EXISTS {schema}.{ready_index};
CREATE INDEX {ready_index} ON {queue} (priority DESC, retry_time, id)
    WHERE subqueue IN ('I', 'R') AND retry_time < 'infinity';
{queue_sequence_index}
