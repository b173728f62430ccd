"""Settings, read from ``NMBUS_*`` environment variables by pydantic-settings.

Build them once where the application starts (``Bus(...)`` or the CLI) and
pass them down; library code never reads the environment itself.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from nmbus.errors import MAX_SECONDS, InvalidSetting
from nmbus.logs import scrub

# Every duration below ends up in a PostgreSQL interval or an asyncio timer:
# inf, NaN or centuries fail there at run time, so they are refused here.
_SECONDS = (
    "lease_seconds",
    "poll_interval",
    "handler_timeout",
    "shutdown_timeout",
    "retry_delay",
    "retry_max_delay",
    "subscription_ttl",
    "reconnect_max_delay",
    "retention_interval",
)
_AGES = ("retention_max_age", "retention_failed_max_age")


class Settings(BaseSettings):
    """Everything that can be tuned, with defaults that suit a small service."""

    model_config = SettingsConfigDict(env_prefix="NMBUS_", extra="forbid", frozen=True)

    dsn: str | None = Field(default=None, description="PostgreSQL DSN (postgresql://...)")
    schema_name: str = Field(default="nmbus", description="schema of the queue tables")
    concurrency: int = Field(default=1, ge=0, description="worker loops, one connection each")
    handler_concurrency: int = Field(
        default=1, ge=1, le=1000, description="handlers of one batch run at once (I/O-bound work)"
    )
    batch_size: int = Field(default=100, ge=1, le=10_000, description="messages per claim")
    lease_seconds: float = Field(default=60.0, gt=0, description="visibility timeout")
    poll_interval: float = Field(default=5.0, gt=0, description="fallback poll, seconds")
    handler_timeout: float = Field(default=30.0, gt=0, description="per-handler limit")
    shutdown_timeout: float = Field(default=30.0, ge=0, description="wait for in-flight work")
    max_message_bytes: int = Field(default=1_048_576, gt=0, description="largest body accepted")
    max_attempts: int = Field(default=5, ge=1, description="default attempts before F")
    retry_delay: float = Field(default=1.0, ge=0, description="default first retry delay")
    retry_max_delay: float = Field(default=300.0, ge=0, description="default longest delay")
    on_unknown: Literal["fail", "skip"] = Field(
        default="fail", description="unknown types / no handler: move to F, or skip to X"
    )
    on_expired: Literal["fail", "drop"] = Field(
        default="fail", description="expired messages: move to F, or drop to X unhandled"
    )
    subscription_ttl: float | None = Field(
        default=3600.0, gt=0, description="subscription lifetime, renewed while running"
    )
    send_pool_size: int = Field(default=4, ge=1, description="connections for send/publish")
    reconnect_max_delay: float = Field(default=10.0, gt=0, description="longest backoff")
    retention_max_age: timedelta = Field(
        default=timedelta(days=7), description="processed (X) rows older than this are removed"
    )
    retention_failed_max_age: timedelta | None = Field(
        default=None, description="failed (F) rows older than this are removed; None keeps them"
    )
    retention_interval: float | None = Field(
        default=None, gt=0, description="seconds between retention runs inside a worker; None: off"
    )
    retention_batch_size: int = Field(
        default=5000, ge=1, le=100_000, description="rows deleted per short transaction"
    )
    retention_archive_dir: str | None = Field(
        default=None, description="write removed rows to Parquet here first (needs pyarrow)"
    )

    @field_validator(*_SECONDS)
    @classmethod
    def _finite_seconds(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value <= MAX_SECONDS):
            raise ValueError(
                f"must be a finite number of seconds, at most {MAX_SECONDS} (10 years)"
            )
        return value

    @field_validator(*_AGES)
    @classmethod
    def _sane_age(cls, value: timedelta | None) -> timedelta | None:
        if value is not None and not timedelta(0) <= value <= timedelta(seconds=MAX_SECONDS):
            raise ValueError("must be between 0 and 10 years")
        return value

    def __repr_args__(self) -> Any:
        # The DSN's password must never reach a log line, a traceback or a repr.
        for name, value in super().__repr_args__():
            yield name, scrub(value) if name == "dsn" and isinstance(value, str) else value


def build_settings(base: Settings | None = None, /, **values: Any) -> Settings:
    """``base`` (else the ``NMBUS_*`` environment) with ``values`` on top, all validated.

    A value that is refused raises :class:`~nmbus.errors.InvalidSetting`, with
    one line naming each bad setting and its environment variable.
    """
    try:
        if base is None:
            return Settings(**values)
        return Settings(**{**dict(base), **values})
    except ValidationError as exc:
        raise InvalidSetting(describe(exc)) from exc


def describe(exc: ValidationError) -> str:
    """One line for a refused Settings: each bad setting, its variable, what is wrong."""
    parts = []
    for error in exc.errors():
        name = ".".join(str(part) for part in error["loc"]) or "settings"
        reason = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            parts.append(f"{name}: no such setting")
            continue
        # Never echo a DSN: it may hold a password.
        got = "" if name == "dsn" else f", got {error['input']!r}"
        parts.append(f"{name} (NMBUS_{name.upper()}): {reason}{got}")
    return "invalid settings: " + "; ".join(parts)
