"""What a failure leads to: the outcome of a message that failed or that no handler may take.

A failed attempt goes to R after its retry policy's delay, or to F when the
policy gives up or the error is permanent; ``RetryLater`` and a lost conflict
(deadlock, serialization failure) go to R without spending the attempt. A
message that is expired, unknown, undecodable or has killed its workers too
often goes to F (or X, when the endpoint's settings say to skip or drop it)
without running a handler. Every outcome carries its ``error_info``.
"""

from __future__ import annotations

import asyncio
import math
import random

import structlog

from nmbus.consume.dispatch.errorinfo import because, error_info
from nmbus.consume.isolation import is_conflict
from nmbus.errors import (
    Expired,
    HandlerCancelled,
    HandlerTimeout,
    MessageError,
    NoHandler,
    PermanentError,
    RetryLater,
    SagaNotFound,
    UnknownMessageType,
)
from nmbus.logs import per_message_logs
from nmbus.messages import Message, StoredMessage
from nmbus.ports.store import Outcomes
from nmbus.retry import RetryPolicy

log = structlog.get_logger("nmbus.worker")

# The longest retry delay written (100 years): beyond it a timestamp overflows.
MAX_DELAY = 100 * 365.25 * 86400
# Deadlocks or serialization failures that one message's handlers may lose in this
# process without spending an attempt; beyond, each is a failed attempt, so a
# handler that conflicts every time (a trigger raising 40001) reaches F.
MAX_FREE_CONFLICTS = 10


def retry_delay(seconds: float) -> float:
    if math.isnan(seconds) or seconds < 0:
        return 0.0
    return min(seconds, MAX_DELAY)


class Failures:
    """Adds the outcome of each failure of one queue's messages to its batch's outcomes."""

    def __init__(self, queue: str, on_unknown: str, on_expired: str) -> None:
        self.queue = queue
        self.on_unknown = on_unknown
        self.on_expired = on_expired
        # Conflicts lost so far by each message that lost one (MAX_FREE_CONFLICTS).
        self._conflicts: dict[int, int] = {}

    def failed(
        self,
        row: StoredMessage,
        exc: BaseException,
        policy: RetryPolicy,
        outcomes: Outcomes,
    ) -> None:
        """Add the outcome of a failed attempt: R after the policy's delay, or F."""
        chatty = per_message_logs()
        if isinstance(exc, RetryLater):
            seconds = retry_delay(exc.seconds)
            outcomes.add(row.id, "R", delay=seconds, error_info=error_info(exc), correction=-1)
            if chatty:
                log.info("message_retry_later", seconds=seconds, reason=exc.reason)
            return
        if isinstance(exc, TimeoutError) and not str(exc):
            exc = because(HandlerTimeout("the handler did not finish within its timeout"), exc)
        elif isinstance(exc, asyncio.CancelledError):
            exc = because(HandlerCancelled("cancelled by something other than the worker"), exc)
        info = error_info(exc)
        if is_conflict(exc) and self._free_conflict(row.id):
            # A deadlock or serialization failure says nothing about the message: its
            # writes were rolled back, it is tried again soon, and the attempt is not spent.
            seconds = retry_delay(random.uniform(0.05, 0.5))
            outcomes.add(row.id, "R", delay=seconds, error_info=info, correction=-1)
            if chatty:
                log.info(
                    "message_conflict_retry", retry_in=round(seconds, 3), error=info.splitlines()[0]
                )
            return
        if isinstance(exc, PermanentError | SagaNotFound) or policy.gives_up_after(row.retry_count):
            outcomes.add(row.id, "F", error_info=info)
            if chatty:
                log.error("message_failed", attempts=row.retry_count, error=info.splitlines()[0])
            return
        seconds = retry_delay(policy.delay(row.retry_count))
        outcomes.add(row.id, "R", delay=seconds, error_info=info)
        if chatty:
            log.warning(
                "message_retry_scheduled",
                attempts=row.retry_count,
                retry_in=round(seconds, 3),
                error=info.splitlines()[0],
            )

    def refused(self, row: StoredMessage, reason: BaseException, outcomes: Outcomes) -> None:
        """Send ``row`` to F without running a handler (a body that does not decode...)."""
        info = error_info(reason)
        outcomes.add(row.id, "F", error_info=info)
        if per_message_logs():
            log.error("message_failed", queue=self.queue, message_id=row.id, error=info)

    def unhandled(self, row: StoredMessage, cls: type[Message] | None, outcomes: Outcomes) -> None:
        """Record a message no handler here takes: F, or X with ``on_unknown="skip"``."""
        unhandled: MessageError = (
            UnknownMessageType(f"no message type {row.label!r} is known to endpoint {self.queue!r}")
            if cls is None
            else NoHandler(f"endpoint {self.queue!r} has no handler for {row.label!r}")
        )
        if self.on_unknown != "skip":
            self.refused(row, unhandled, outcomes)
            return
        reason = error_info(unhandled)
        outcomes.add(row.id, "X", error_info=f"skipped: {reason}")
        if per_message_logs():
            log.warning("message_skipped", queue=self.queue, message_id=row.id, reason=reason)

    def expired(self, row: StoredMessage, outcomes: Outcomes) -> None:
        """Record an expired row without running a handler: F, or X with ``on_expired="drop"``."""
        reason = error_info(
            Expired(f"{row.label} expired before a handler took it (attempt {row.retry_count})")
        )
        if self.on_expired == "drop":
            outcomes.add(row.id, "X", error_info=f"dropped: {reason}")
        else:
            outcomes.add(row.id, "F", error_info=reason)
        if per_message_logs():
            log.warning(
                "message_expired", queue=self.queue, message_id=row.id, action=self.on_expired
            )

    def _free_conflict(self, id: int) -> bool:
        """Whether message ``id``'s conflict may cost no attempt (its first MAX_FREE_CONFLICTS)."""
        if len(self._conflicts) >= 10_000 and id not in self._conflicts:
            self._conflicts.clear()  # bounded: forgetting only makes more conflicts free
        lost = self._conflicts[id] = self._conflicts.get(id, 0) + 1
        return lost <= MAX_FREE_CONFLICTS
