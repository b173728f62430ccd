"""nmbus: an asyncio message bus on PostgreSQL queue tables.

Every endpoint has its own queue table; rows move through the subqueues
I (ready), R (scheduled), X (processed) and F (failed).
"""

from nmbus.bus import Bus
from nmbus.context import Context
from nmbus.errors import (
    ConfigurationError,
    DatabaseUnavailable,
    InvalidQueueName,
    MessageTooLarge,
    NmbusError,
    PermanentError,
    RetryLater,
    StoreError,
)
from nmbus.messages import Message
from nmbus.retry import RetryPolicy
from nmbus.settings import Settings

__all__ = [
    "Bus",
    "ConfigurationError",
    "Context",
    "DatabaseUnavailable",
    "InvalidQueueName",
    "Message",
    "MessageTooLarge",
    "NmbusError",
    "PermanentError",
    "RetryLater",
    "RetryPolicy",
    "Settings",
    "StoreError",
]
