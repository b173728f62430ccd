"""PostgreSQL adapter: the asyncpg store, schema installation, error mapping."""

from nmbus.postgres.store import (
    PostgresStore,
    blocked_sequences,
    install_schema,
    notify_channel,
)

__all__ = ["PostgresStore", "blocked_sequences", "install_schema", "notify_channel"]
