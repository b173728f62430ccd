-- migrate_2_fillfactor --
-- Schema version 2: queue tables leave half of each page free (was 80 % full),
-- so claims stay HOT updates. Applies to pages written from now on.
ALTER TABLE {queue} SET (fillfactor = 50);
