-- migrate_4_isolated --
-- Schema version 4: `isolated` marks a lease taken for one row alone, after a
-- crash, so that the next crash is blamed on that row only (no table rewrite).
ALTER TABLE {queue} ADD COLUMN IF NOT EXISTS isolated boolean NOT NULL DEFAULT false;
