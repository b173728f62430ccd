"""Exceptions raised by nmbus.

The whole tree::

    NmbusError
    ├── ConfigurationError          misuse of the API, raised at registration time
    │   ├── InvalidQueueName        a queue name that cannot be a table name
    │   ├── InvalidSetting          a setting, retry policy or delay nmbus cannot honour
    │   └── HandlerError            a handler whose signature cannot be dispatched
    ├── MessageError                a message that cannot be sent or received
    │   ├── MessageTooLarge         body over the configured size limit (at send)
    │   ├── InvalidMessage          a body, header or id its receiver could not read (at send)
    │   ├── UnknownMessageType      a label no registered Message class carries
    │   └── UndecodableMessage      a body that does not parse or validate
    ├── StoreError                  the database said no; the driver error is __cause__
    │   ├── DatabaseUnavailable     cannot connect, or the connection was lost
    │   ├── QueueNotFound           no table for that queue
    │   ├── LeaseLost               another worker took over messages of a batch
    │   └── SchemaVersionError      the database schema is newer than this nmbus
    └── HandlerSignal               raised by handlers to steer their message
        ├── PermanentError          do not retry: move the message to F now
        └── RetryLater              retry after ``seconds``; not counted as a failure

Driver exceptions (asyncpg, OSError) are translated into StoreError in one
place, :mod:`nmbus.postgres.errors`.
"""

from __future__ import annotations

import math

# The longest delay, timeout or age nmbus accepts: 10 years, in seconds. Longer
# is a mistake (PostgreSQL intervals and timestamps overflow not far beyond).
MAX_SECONDS = 10 * 365 * 24 * 3600


class NmbusError(Exception):
    """Base of every exception nmbus raises."""


class ConfigurationError(NmbusError):
    """The API was used in a way that can never work."""


class InvalidQueueName(ConfigurationError, ValueError):
    """A queue (endpoint) name that nmbus refuses to turn into a table name."""


class InvalidSetting(ConfigurationError, ValueError):
    """A setting, retry policy or delay that is not finite or out of range, refused at once."""


class HandlerError(ConfigurationError, TypeError):
    """A handler that cannot be registered."""


class MessageError(NmbusError):
    """A message that cannot be sent or received."""


class MessageTooLarge(MessageError, ValueError):
    """The serialized message is larger than ``max_message_bytes``."""


class InvalidMessage(MessageError, ValueError):
    """A message that its receiver could not read back: refused at send, never stored."""


class UnknownMessageType(MessageError):
    """No registered Message class has this type name."""


class UndecodableMessage(MessageError):
    """The stored body is not valid JSON for its message type."""


class StoreError(NmbusError):
    """The database refused or failed an operation."""


class DatabaseUnavailable(StoreError):
    """The database cannot be reached, or the connection was lost."""


class LeaseLost(StoreError):
    """Another worker took over messages of this batch (their lease ran out)."""


class QueueNotFound(StoreError):
    """The queue table does not exist."""


class SchemaVersionError(StoreError):
    """The database holds a schema this version of nmbus does not know."""


class HandlerSignal(NmbusError):
    """Base of the exceptions a handler raises on purpose."""


class PermanentError(HandlerSignal):
    """The message can never succeed: move it to F without further attempts."""


class RetryLater(HandlerSignal):
    """Try the message again after ``seconds``; the attempt does not count."""

    def __init__(self, seconds: float, reason: str = "") -> None:
        if not (math.isfinite(seconds) and 0 <= seconds <= MAX_SECONDS):
            # Raised inside a handler, this fails the attempt with this message.
            raise InvalidSetting(
                f"RetryLater needs seconds >= 0 and finite, at most {MAX_SECONDS} "
                f"(10 years), got {seconds}"
            )
        self.seconds = float(seconds)
        self.reason = reason
        super().__init__(reason or f"retry in {seconds:g}s")
