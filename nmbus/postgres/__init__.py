"""PostgreSQL adapter: the asyncpg store, schema installation, error mapping."""

from nmbus.postgres.listen import notify_channel
from nmbus.postgres.schema import install_schema
from nmbus.postgres.store import PostgresStore

__all__ = ["PostgresStore", "install_schema", "notify_channel"]
