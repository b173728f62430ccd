"""PostgreSQL adapter: the asyncpg store, schema installation, error mapping."""

from nmbus.postgres.store import (
    PostgresStore,
    install_schema,
    notify_channel,
)

__all__ = ["PostgresStore", "install_schema", "notify_channel"]
