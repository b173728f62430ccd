-- migrate_16_claim_check --
-- Schema version 16: the payloads the claim check stores apart (docs/messages.md).
{payloads_table}
