"""Cancellation: a message that has not started never runs (DESIGN.md section 10).

``bus.cancel(queue, unique_id=...)`` or ``correlation_id=...`` moves the
queue's matching messages that no worker holds (I or R, no live lease) to F,
with an ``error_info`` that starts ``Cancelled``, in one statement. A message a
worker holds (running, or claimed and about to start) is left alone, as is one
already done: the count says how many were cancelled. A claim and a cancel of
one message meet on its row lock, so the message is either cancelled or runs,
never both, and a cancelled message can be requeued like any failed one.
"""

from __future__ import annotations

from dataclasses import dataclass

from nmbus.names import check_key

#: How error_info of a cancelled message begins.
CANCELLED = "Cancelled"


@dataclass(frozen=True)
class Cancel:
    """What to cancel: the messages of one unique_id, or of one correlation_id."""

    unique_id: str | None = None
    correlation_id: str | None = None

    @classmethod
    def of(cls, unique_id: object = None, correlation_id: object = None) -> Cancel:
        """Check the request: exactly one key, each a key a message could carry."""
        if (unique_id is None) == (correlation_id is None):
            raise ValueError("cancel takes exactly one of unique_id= and correlation_id=")
        if unique_id is not None:
            return cls(unique_id=check_key("unique_id", unique_id))
        return cls(correlation_id=check_key("correlation_id", correlation_id))

    @property
    def reason(self) -> str:
        """The error_info of a message cancelled by this request."""
        if self.unique_id is not None:
            return f"{CANCELLED} before it started (unique_id {self.unique_id!r})"
        return f"{CANCELLED} before it started (correlation_id {self.correlation_id!r})"
