"""nmbus: an asyncio message bus on PostgreSQL queue tables.

Every endpoint has its own queue table; rows move through the subqueues
I (ready), R (scheduled), X (processed) and F (failed).
"""

from nmbus.bus import Bus
from nmbus.context import Context, Effects
from nmbus.contracts.encryption import Encrypted
from nmbus.delivery.periodic import Tick
from nmbus.envelopes import PublishOptions, SendOptions
from nmbus.errors import (
    AttemptFailed,
    AttemptsExhausted,
    ConfigurationError,
    DatabaseUnavailable,
    Expired,
    HandlerCancelled,
    HandlerError,
    HandlerSignal,
    HandlerTimeout,
    InvalidMessage,
    InvalidQueueName,
    InvalidSetting,
    LeaseLost,
    MessageError,
    MessageTooLarge,
    MessageVersionError,
    NmbusError,
    NoHandler,
    OutcomeNotRecorded,
    PermanentError,
    QueueNotFound,
    RetentionError,
    RetryLater,
    SagaNotFound,
    SchemaVersionError,
    StoreError,
    ToolError,
    UndecodableMessage,
    UnknownEncryptionKey,
    UnknownMessageType,
)
from nmbus.messages import Message
from nmbus.retry import RetryPolicy
from nmbus.sagas.saga import Saga
from nmbus.settings import Settings


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nmbus")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "0+unknown"


__version__ = _installed_version()
del _installed_version

__all__ = [
    "AttemptFailed",
    "AttemptsExhausted",
    "Bus",
    "ConfigurationError",
    "Context",
    "DatabaseUnavailable",
    "Effects",
    "Encrypted",
    "Expired",
    "HandlerCancelled",
    "HandlerError",
    "HandlerSignal",
    "HandlerTimeout",
    "InvalidMessage",
    "InvalidQueueName",
    "InvalidSetting",
    "LeaseLost",
    "Message",
    "MessageError",
    "MessageTooLarge",
    "MessageVersionError",
    "NmbusError",
    "NoHandler",
    "OutcomeNotRecorded",
    "PermanentError",
    "PublishOptions",
    "QueueNotFound",
    "RetentionError",
    "RetryLater",
    "RetryPolicy",
    "Saga",
    "SagaNotFound",
    "SchemaVersionError",
    "SendOptions",
    "Settings",
    "StoreError",
    "Tick",
    "ToolError",
    "UndecodableMessage",
    "UnknownEncryptionKey",
    "UnknownMessageType",
]
