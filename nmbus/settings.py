"""Settings, read from ``NMBUS_*`` environment variables by pydantic-settings.

Build them once where the application starts (``Bus(...)`` or the CLI) and
pass them down; library code never reads the environment itself.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Annotated, Any, Literal

import structlog
from pydantic import Field, GetCoreSchemaHandler, ValidationError, field_validator, model_validator
from pydantic_core import core_schema
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from nmbus.errors import MAX_SECONDS, InvalidQueueName, InvalidSetting
from nmbus.logs import scrub
from nmbus.names import validate_queue_name

# Every duration below ends up in a PostgreSQL interval or an asyncio timer:
# inf, NaN or centuries fail there at run time, so they are refused here.
_SECONDS = (
    "batch_commit_interval",
    "lease_seconds",
    "poll_interval",
    "handler_timeout",
    "shutdown_timeout",
    "retry_delay",
    "retry_max_delay",
    "subscription_ttl",
    "reconnect_max_delay",
    "retention_interval",
    "segment_seconds",
)
_AGES = ("retention_max_age", "retention_failed_max_age")
#: The shortest and longest span of time one segment may cover (docs/storage.md).
SEGMENT_SECONDS = (1.0, 31 * 86400.0)
# The shortest lease the design honours: it must outlast several round trips,
# and the renewer runs every lease/3. Shorter, a live handler's message is taken
# over by another worker and handled twice.
MIN_LEASE_SECONDS = 1.0
# A message is its body and headers; PostgreSQL's text values end at 1 GiB, and a
# message is copied on every hop: 256 MiB is far beyond any sane one.
MIN_MESSAGE_BYTES = 64
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

# NMBUS_DB_<ALIAS>: a database that NMBUS_ROUTES refers to by its alias.
DATABASE_PREFIX = "NMBUS_DB_"
_ALIAS = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,39}")
_DSN_START = ("postgresql://", "postgres://")
# A name that is safe to repeat in an error: no DSN punctuation, so no password.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,48}")
# The commas that separate pairs: those followed by ``name=`` and a DSN scheme or
# an alias. Any other comma belongs to the value (a password may hold one).
_PAIR_COMMA = re.compile(
    r",(?=\s*[A-Za-z_][A-Za-z0-9_.\-]*\s*=\s*"
    r"(?:[A-Za-z][A-Za-z0-9+.\-]*:|[A-Za-z][A-Za-z0-9_]*\s*(?:,|$)))"
)


def _pairs(value: Any, what: str) -> Any:
    """``"a=x, b=y"`` (the environment's form) as a dict; dicts pass through.

    The values may be DSNs: an error never repeats one (nor a part of one).
    """
    if not isinstance(value, str):
        return value
    found: dict[str, str] = {}
    for part in _PAIR_COMMA.split(value):
        part = part.strip()
        if not part:
            continue
        name, sep, target = part.partition("=")
        if not sep or not name.strip() or not target.strip():
            raise ValueError(
                f"expected {what} pairs separated by commas (a value that is not a "
                "pair was left out of this message: it may hold a password)"
            )
        found[name.strip()] = target.strip()
    return found


def _looks_like_dsn(value: str) -> bool:
    # URL schemes are case-insensitive (asyncpg reads PostgreSQL:// too).
    return value[:13].lower().startswith(_DSN_START)


def _shown(name: str) -> str:
    """``name`` quoted for an error when it cannot hold a password, else a placeholder."""
    return repr(name) if _PLAIN_NAME.fullmatch(name) else "(not shown: it may hold a password)"


_KEY_ID = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_KEY_BYTES = (16, 24, 32)


class EncryptionKeys:
    """The AES keys of encrypted fields, by key id (docs/messages.md).

    Built from a mapping ``{id: key}`` (each key 16, 24 or 32 bytes, raw or
    base64) or the environment's ``"id:<base64>,id:<base64>"``. Its repr, and
    every error about it, shows the key ids only, never a key.
    """

    __slots__ = ("_keys", "current")

    def __init__(self, keys: Mapping[str, bytes | str], current: str | None = None) -> None:
        if not keys:
            raise ValueError("needs at least one key")
        self._keys: dict[str, bytes] = {}
        for key_id, key in keys.items():
            if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id):
                raise ValueError(
                    "a key id is 1 to 64 letters, digits, '_', '.' or '-' (the id refused "
                    "is left out of this message)"
                )
            self._keys[key_id] = _key_bytes(key_id, key)
        #: The id new messages are encrypted with.
        self.current = current if current is not None else next(iter(self._keys))

    @classmethod
    def of(cls, value: Any) -> EncryptionKeys | None:
        if value is None or isinstance(value, EncryptionKeys):
            return value
        if isinstance(value, str):
            pairs: dict[str, bytes | str] = {}
            for part in value.split(","):
                key_id, sep, key = part.strip().partition(":")
                if not sep or not key_id.strip() or not key.strip():
                    raise ValueError(
                        "expected id:<base64 key> pairs separated by commas (the value "
                        "is left out of this message: it holds keys)"
                    )
                pairs[key_id.strip()] = key.strip()
            return cls(pairs)
        if isinstance(value, Mapping):
            return cls(value)
        raise ValueError("expected a mapping of key id to key, or id:<base64 key> pairs")

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        # As JSON, the ids only: a dumped Settings never carries a key.
        return core_schema.no_info_plain_validator_function(
            cls.of,
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda keys: {"ids": list(keys.ids), "current": keys.current}, when_used="json"
            ),
        )

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(self._keys)

    def __contains__(self, key_id: object) -> bool:
        return key_id in self._keys

    def key(self, key_id: str) -> bytes:
        """The key of ``key_id`` (KeyError, naming the id only, when there is none)."""
        return self._keys[key_id]

    def using(self, current: str) -> EncryptionKeys:
        """These keys, with ``current`` the id new messages are encrypted with."""
        if current not in self._keys:
            raise ValueError(
                f"key id {current!r} is not among the keys (ids: {', '.join(self._keys)})"
            )
        found = EncryptionKeys.__new__(EncryptionKeys)
        found._keys = self._keys
        found.current = current
        return found

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, EncryptionKeys)
            and other._keys == self._keys
            and other.current == self.current
        )

    def __hash__(self) -> int:
        return hash((tuple(self._keys), self.current))

    def __repr__(self) -> str:
        return f"EncryptionKeys(ids={list(self._keys)!r}, current={self.current!r})"

    __str__ = __repr__


def _key_bytes(key_id: str, key: bytes | str) -> bytes:
    if isinstance(key, str):
        try:
            key = base64.b64decode(key, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"key {key_id!r} is not valid base64") from None
    if not isinstance(key, bytes) or len(key) not in _KEY_BYTES:
        raise ValueError(
            f"key {key_id!r} must be 16, 24 or 32 bytes (AES-128, -192 or -256), "
            "given as bytes or base64"
        )
    return key


class _Databases(PydanticBaseSettingsSource):
    """``NMBUS_DB_<ALIAS>=postgresql://...`` variables, gathered into ``databases``."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        found = {
            name[len(DATABASE_PREFIX) :].lower(): value
            for name, value in os.environ.items()
            if name.upper().startswith(DATABASE_PREFIX) and len(name) > len(DATABASE_PREFIX)
        }
        return {"databases": found} if found else {}


#: Settings an older nmbus had, each with what to do instead: set by an old
#: deployment, one is warned of once and otherwise ignored.
REMOVED = {
    "held_batches": "every claim leases its rows now (docs/reliability.md); unset it",
}
_warned: set[str] = set()


def _warn_removed(name: str, where: str) -> None:
    if name in _warned:
        return
    _warned.add(name)
    structlog.get_logger("nmbus.settings").warning(
        "setting_removed", setting=name, where=where, note=REMOVED[name]
    )


class _Removed(PydanticBaseSettingsSource):
    """``NMBUS_<NAME>`` of a removed setting: warned of once, read as nothing."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        for name in REMOVED:
            variable = f"NMBUS_{name.upper()}"
            if any(key.upper() == variable for key in os.environ):
                _warn_removed(name, variable)
        return {}


class Settings(BaseSettings):
    """Everything that can be tuned, with defaults that suit a small service."""

    # hide_input_in_errors: pydantic's own error text never repeats a value (a DSN).
    model_config = SettingsConfigDict(
        env_prefix="NMBUS_", extra="forbid", frozen=True, hide_input_in_errors=True
    )

    dsn: str | None = Field(default=None, description="PostgreSQL DSN (postgresql://...)")
    schema_name: str = Field(default="nmbus", description="schema of the queue tables")
    concurrency: int = Field(
        default=2,
        ge=0,
        le=1000,
        description="worker loops, one connection each (two keep the database and Python busy)",
    )
    handler_concurrency: int = Field(
        default=1, ge=1, le=1000, description="handlers of one batch run at once (I/O-bound work)"
    )
    batch_size: int | None = Field(
        default=None,
        ge=1,
        le=10_000,
        description="messages per claim; unset: each loop adapts it (nmbus/consume/sizing.py)",
    )
    batch_commit_interval: float = Field(
        default=0.5, gt=0, description="commit what a batch has handled at least this often"
    )
    lease_seconds: float = Field(default=60.0, gt=0, description="visibility timeout")
    poll_interval: float = Field(default=5.0, ge=0.01, description="fallback poll, seconds")
    handler_timeout: float = Field(default=30.0, ge=0.01, description="per-handler limit")
    shutdown_timeout: float = Field(default=30.0, ge=0, description="wait for in-flight work")
    max_message_bytes: int = Field(
        default=1_048_576,
        ge=MIN_MESSAGE_BYTES,
        le=MAX_MESSAGE_BYTES,
        description="largest message accepted: body and headers",
    )
    max_attempts: int = Field(
        default=5, ge=1, le=1_000_000, description="default attempts before F"
    )
    retry_delay: float = Field(default=1.0, ge=0, description="default first retry delay")
    retry_max_delay: float = Field(default=300.0, ge=0, description="default longest delay")
    on_unknown: Literal["fail", "skip"] = Field(
        default="fail", description="unknown types / no handler: move to F, or skip to X"
    )
    on_expired: Literal["fail", "drop"] = Field(
        default="fail", description="expired messages: move to F, or drop to X unhandled"
    )
    subscription_ttl: float | None = Field(
        default=3600.0, ge=0.5, description="subscription lifetime, renewed while running"
    )
    send_pool_size: int = Field(
        default=4, ge=1, le=1000, description="connections for send/publish"
    )
    reconnect_max_delay: float = Field(default=10.0, ge=0.1, description="longest backoff")
    pooler: Literal["none", "transaction"] = Field(
        default="none",
        description="what the DSN reaches: PostgreSQL itself, or a transaction pooler "
        "(PgBouncer, pool_mode = transaction): no prepared statements, no LISTEN through it",
    )
    listen_dsn: str | None = Field(
        default=None,
        description="with pooler=transaction: a DSN that bypasses the pooler, for LISTEN; "
        "unset: wake-ups by polling every poll_interval",
    )
    retention_max_age: timedelta = Field(
        default=timedelta(days=7), description="processed (X) rows older than this are removed"
    )
    retention_failed_max_age: timedelta | None = Field(
        default=None, description="failed (F) rows older than this are removed; None keeps them"
    )
    retention_interval: float | None = Field(
        default=None,
        ge=0.1,
        description="seconds between retention runs inside a worker; None: off",
    )
    segment_seconds: float = Field(
        default=3600.0,
        ge=SEGMENT_SECONDS[0],
        le=SEGMENT_SECONDS[1],
        description="the span of time one segment of a queue table covers, at most 16 "
        "segments kept (docs/storage.md)",
    )
    retention_batch_size: int = Field(
        default=5000, ge=1, le=100_000, description="rows deleted per short transaction"
    )
    retention_archive_dir: str | None = Field(
        default=None, description="write removed rows to Parquet here first (needs pyarrow)"
    )
    routes: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="queues living in other databases: queue=alias pairs (docs/routes.md)",
    )
    databases: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="aliases of routes: alias=DSN pairs, or one NMBUS_DB_<ALIAS> variable each",
    )
    create_queues: bool = Field(
        default=True,
        description="a send to a queue no endpoint created creates it (marked, logged once); "
        "false: refused with QueueNotFound",
    )
    forward_batch_size: int = Field(
        default=500, ge=1, le=10_000, description="outbox rows moved per remote transaction"
    )

    encryption_keys: Annotated[EncryptionKeys | None, NoDecode] = Field(
        default=None,
        description="keys of Encrypted fields: id:<base64 key> pairs, 16/24/32 bytes each "
        "(docs/messages.md); never shown",
    )
    encryption_key_id: str | None = Field(
        default=None, description="the key id new messages are encrypted with"
    )

    claim_check_bytes: int | None = Field(
        default=None,
        ge=MIN_MESSAGE_BYTES,
        le=MAX_MESSAGE_BYTES,
        description="a body over this many bytes is stored apart and its row keeps a "
        "reference (docs/messages.md); None: off",
    )
    claim_check_store: str | None = Field(
        default=None,
        min_length=1,
        max_length=2000,
        description="where bodies stored apart go: any fsspec URL (file:///shared/x); "
        "None: a table of the endpoint, in the message's transaction",
    )

    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="serve worker metrics on this port (0: any free one); None: off",
    )
    metrics_host: str = Field(
        default="127.0.0.1", min_length=1, max_length=255, description="address of /metrics"
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            init_settings,
            env_settings,
            _Databases(settings_cls),
            _Removed(settings_cls),
            dotenv_settings,
            file_secret_settings,
        )

    @model_validator(mode="before")
    @classmethod
    def _drop_removed(cls, values: Any) -> Any:
        if isinstance(values, dict):
            for name in REMOVED.keys() & values.keys():
                _warn_removed(name, name)
                values = {k: v for k, v in values.items() if k != name}
        return values

    @field_validator("routes", mode="before")
    @classmethod
    def _parse_routes(cls, value: Any) -> Any:
        return _pairs(value, "queue=alias")

    @field_validator("databases", mode="before")
    @classmethod
    def _parse_databases(cls, value: Any) -> Any:
        return _pairs(value, "alias=postgresql://...")

    @field_validator("databases")
    @classmethod
    def _check_databases(cls, value: dict[str, str]) -> dict[str, str]:
        for alias, dsn in value.items():
            if not isinstance(alias, str) or not _ALIAS.fullmatch(alias):
                raise ValueError(
                    f"database alias {_shown(str(alias))}: 1-40 letters, digits or '_', "
                    "starting with a letter (NMBUS_DATABASES takes alias=postgresql://... pairs)"
                )
            if not _looks_like_dsn(dsn):
                # Never echo the value: it may hold a password.
                raise ValueError(f"database {alias!r} must be a postgresql://... DSN")
        return {alias.lower(): dsn for alias, dsn in value.items()}

    @model_validator(mode="after")
    def _check_routes(self) -> Settings:
        for queue, target in self.routes.items():
            try:
                validate_queue_name(queue)
            except InvalidQueueName:
                raise ValueError(
                    f"routes: invalid queue name {_shown(queue)}: use 1-48 letters, digits, "
                    "'_', '.' or '-', starting with a letter or '_'"
                ) from None
            if _looks_like_dsn(target):
                continue
            if not _ALIAS.fullmatch(target):
                # Neither an alias nor a postgresql:// DSN: never echo it (a DSN of
                # another spelling, or a keyword DSN, may hold a password).
                raise ValueError(
                    f"routes: queue {queue!r} goes to a database given neither as a "
                    "postgresql://... DSN nor as an alias of NMBUS_DB_<ALIAS> (the value "
                    "is not shown: it may hold a password)"
                )
            if target.lower() not in self.databases:
                raise ValueError(
                    f"routes: queue {queue!r} goes to database {target!r}, which is not defined "
                    f"(set {DATABASE_PREFIX}{target.upper()}=postgresql://...)"
                )
        return self

    @model_validator(mode="after")
    def _check_encryption(self) -> Settings:
        keys, current = self.encryption_keys, self.encryption_key_id
        if current is None:
            if keys is not None and len(keys.ids) > 1:
                raise ValueError(
                    "encryption_key_id (NMBUS_ENCRYPTION_KEY_ID) must name the key new "
                    f"messages use, one of {', '.join(keys.ids)}"
                )
        elif keys is None:
            raise ValueError(
                "encryption_key_id (NMBUS_ENCRYPTION_KEY_ID) needs encryption_keys "
                "(NMBUS_ENCRYPTION_KEYS)"
            )
        elif current not in keys:
            raise ValueError(
                f"encryption_key_id (NMBUS_ENCRYPTION_KEY_ID) {_shown(current)} is not among "
                f"encryption_keys (ids: {', '.join(keys.ids)})"
            )
        elif keys.current != current:
            # The ring carries its current id, so that the bus needs only the ring.
            object.__setattr__(self, "encryption_keys", keys.using(current))
        return self

    @model_validator(mode="after")
    def _check_claim_check(self) -> Settings:
        over, limit = self.claim_check_bytes, self.max_message_bytes
        if over is not None and over >= limit:
            raise ValueError(
                f"claim_check_bytes (NMBUS_CLAIM_CHECK_BYTES) {over} must be below "
                f"max_message_bytes (NMBUS_MAX_MESSAGE_BYTES) {limit}: a body between the "
                "two could be neither stored apart nor sent"
            )
        return self

    @model_validator(mode="after")
    def _check_listen_dsn(self) -> Settings:
        if self.listen_dsn is not None and self.pooler != "transaction":
            raise ValueError(
                "listen_dsn (NMBUS_LISTEN_DSN) bypasses a transaction pooler for LISTEN: "
                "it needs pooler=transaction (NMBUS_POOLER); without a pooler, LISTEN uses dsn"
            )
        return self

    def route_dsns(self) -> dict[str, str]:
        """Each routed queue with the DSN of the database it lives in."""
        return {
            queue: target if _looks_like_dsn(target) else self.databases[target.lower()]
            for queue, target in self.routes.items()
        }

    @field_validator(*_SECONDS)
    @classmethod
    def _finite_seconds(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value <= MAX_SECONDS):
            raise ValueError(
                f"must be a finite number of seconds, at most {MAX_SECONDS} (10 years)"
            )
        return value

    @field_validator("lease_seconds")
    @classmethod
    def _long_enough_lease(cls, value: float) -> float:
        if value < MIN_LEASE_SECONDS:
            raise ValueError(
                f"must be at least {MIN_LEASE_SECONDS:g} second: a lease must outlast several "
                "round trips to the database, and it is renewed every lease/3"
            )
        return value

    @field_validator(*_AGES)
    @classmethod
    def _sane_age(cls, value: timedelta | None) -> timedelta | None:
        if value is not None and not timedelta(0) <= value <= timedelta(seconds=MAX_SECONDS):
            raise ValueError("must be between 0 and 10 years")
        return value

    @field_validator("claim_check_store")
    @classmethod
    def _store_url(cls, value: str | None) -> str | None:
        if value is not None and "://" not in value:
            raise ValueError(
                "must be an fsspec URL with its protocol, such as file:///shared/payloads"
            )
        return value

    @field_validator("metrics_host")
    @classmethod
    def _host(cls, value: str) -> str:
        if value != value.strip() or any(ch.isspace() or ord(ch) < 32 for ch in value):
            raise ValueError("must be a host name or address, without spaces")
        return value

    def __repr_args__(self) -> Any:
        # The DSN's password must never reach a log line, a traceback or a repr.
        for name, value in super().__repr_args__():
            if name in ("dsn", "listen_dsn", "claim_check_store") and isinstance(value, str):
                value = scrub(value)
            elif name in ("routes", "databases") and isinstance(value, dict):
                value = {k: scrub(v) for k, v in value.items()}
            yield name, value


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
        if not error["loc"]:
            parts.append(reason)  # a check across settings (routes): its text names them
            continue
        # Never echo a DSN: it may hold a password.
        secret = name.split(".")[0] in (
            "dsn",
            "listen_dsn",
            "claim_check_store",
            "routes",
            "databases",
            "encryption_keys",
            "encryption_key_id",
        )
        got = "" if secret else f", got {error['input']!r}"
        variable = (
            "NMBUS_DATABASES or NMBUS_DB_<ALIAS>"
            if name.startswith("databases")
            else f"NMBUS_{name.upper()}"
        )
        parts.append(f"{name} ({variable}): {reason}{got}")
    return "invalid settings: " + "; ".join(parts)
