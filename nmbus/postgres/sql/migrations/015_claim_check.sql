-- migrate_15_claim_check --
-- Schema version 15: the payloads the claim check stores apart (docs/messages.md).
{payloads_table}
