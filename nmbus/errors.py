"""Exceptions raised by nmbus.

The whole tree::

    NmbusError
    ├── ConfigurationError          misuse of the API, raised at registration time
    │   ├── InvalidQueueName        a queue name that cannot be a table name
    │   ├── InvalidSetting          a setting, retry policy or delay nmbus cannot honour
    │   └── HandlerError            a handler whose signature cannot be dispatched
    ├── MessageError                a message that cannot be sent or received
    │   ├── MessageTooLarge         body and headers over the size limit (at send)
    │   ├── InvalidMessage          a body, header or id its receiver could not read (at send)
    │   ├── UnknownMessageType      a label no registered Message class carries   (F)
    │   ├── NoHandler               a known type this endpoint has no handler for (F)
    │   ├── UndecodableMessage      a body that does not parse or validate        (F)
    │   ├── MessageVersionError     a body version this process cannot upcast     (F)
    │   ├── UnknownEncryptionKey    an encrypted field under a key id not held    (F)
    │   ├── SagaNotFound            a saga's non-start message found no saga      (F)
    │   └── Expired                 its expires_at passed before a handler got it (F)
    ├── AttemptFailed               why an attempt failed, beside a handler's own error
    │   ├── AttemptsExhausted       its attempts died with their workers          (F)
    │   ├── HandlerTimeout          the handler ran past its timeout              (R/F)
    │   ├── HandlerCancelled        cancelled by something other than the worker  (R/F)
    │   └── OutcomeNotRecorded      the batch's outcome could not be committed    (R/F)
    ├── StoreError                  the database said no; the driver error is __cause__
    │   ├── DatabaseUnavailable     cannot connect, or the connection was lost
    │   ├── QueueNotFound           no table for that queue
    │   ├── LeaseLost               another worker took over messages of a batch
    │   └── SchemaVersionError      the database schema is newer than this nmbus
    ├── RetentionError              retention could not archive or remove rows as planned
    ├── ToolError                   a tool (demo, bench, soak, report) could not do its work
    └── HandlerSignal               raised by handlers to steer their message
        ├── PermanentError          do not retry: move the message to F now
        └── RetryLater              retry after ``seconds``; not counted as a failure

Those marked (F) or (R/F) are what a worker records rather than raises: the
first line of a row's ``error_info`` is ``<ClassName>: <message>``, so the
statistics job and an operator group failures by these names (a handler's own
exception appears under its own name).

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
    """The serialized message (body and headers) is larger than ``max_message_bytes``."""


class InvalidMessage(MessageError, ValueError):
    """A message that its receiver could not read back: refused at send, never stored."""


class UnknownMessageType(MessageError):
    """No registered Message class has this type name."""


class NoHandler(MessageError):
    """The message's type is known, but this endpoint has no handler for it."""


class UndecodableMessage(MessageError):
    """The stored body is not valid JSON for its message type."""


class MessageVersionError(MessageError):
    """A stored body of a version this process cannot read: newer than its class, or
    older with no complete chain of upcasters to the class's version."""


class UnknownEncryptionKey(MessageError):
    """An encrypted field names a key id this endpoint does not hold (never the key)."""


class SagaNotFound(MessageError):
    """A saga handler that may not start its saga got a message for a saga that does not exist."""


class Expired(MessageError):
    """The message's expiry (ttl / expires_at) passed before a worker handed it to a handler."""


class AttemptFailed(NmbusError):
    """Why an attempt failed when the reason is not a handler's own exception."""


class AttemptsExhausted(AttemptFailed):
    """Its attempts all died with their workers: failed without running again."""


class HandlerTimeout(AttemptFailed):
    """The handler did not finish within its timeout and was cancelled."""


class HandlerCancelled(AttemptFailed):
    """The handler was cancelled by something other than the worker's shutdown."""


class OutcomeNotRecorded(AttemptFailed):
    """The batch's outcome could not be committed (what the handler wrote was rolled back)."""


class StoreError(NmbusError):
    """The database refused or failed an operation."""


#: SQLSTATE of a statement the server cancelled (its ``statement_timeout``, or an
#: operator's ``pg_cancel_backend``): the statement was rolled back, nothing else.
QUERY_CANCELED = "57014"
#: SQLSTATE of a connection refused for the server's, a database's or a role's
#: connection limit (``max_connections``, ``CONNECTION LIMIT``).
TOO_MANY_CONNECTIONS = "53300"


def cancelled_by_server(exc: BaseException) -> bool:
    """Whether ``exc`` comes of a statement the server cancelled (``statement_timeout``)."""
    return caused_by(exc, _CANCELLED)


_CANCELLED = frozenset({QUERY_CANCELED})


def caused_by(exc: BaseException, states: frozenset[str] | set[str]) -> bool:
    """Whether ``exc``, or an exception that caused it, carries one of SQLSTATEs ``states``.

    The chain is read as a traceback reads it: the cause, else the context
    unless suppressed.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if getattr(current, "sqlstate", None) in states:
            return True
        if current.__cause__ is not None:
            current = current.__cause__
        else:
            current = None if current.__suppress_context__ else current.__context__
    return False


class DatabaseUnavailable(StoreError):
    """The database cannot be reached, or the connection was lost."""


class LeaseLost(StoreError):
    """Another worker took over messages of this batch (their lease ran out)."""


class QueueNotFound(StoreError):
    """The queue table does not exist."""


class SchemaVersionError(StoreError):
    """The database holds a schema this version of nmbus does not know."""


class RetentionError(NmbusError):
    """Retention could not remove a batch exactly as archived; nothing was deleted."""


class ToolError(NmbusError):
    """A tool (demo, bench, soak, report) could not do its work."""


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
