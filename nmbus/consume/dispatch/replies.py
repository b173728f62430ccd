"""Replies: where a reply that comes in goes, when its type's handlers are not the place.

A message with the ``nmbus-in-reply-to`` header answers a request. The one a
request of this process waits for resolves that request and goes to X (its
handlers do not run). One that another live request of this endpoint, in
another process, waits for goes back for that process (to R, shortly, the
attempt not counted), for at most ``HAND_BACK_MAX_AGE`` seconds after the
reply was sent. A late one, that no request waits for any more, is handled like
any message; with no handler it goes to X with a note rather than to F.
"""

from __future__ import annotations

from datetime import UTC, datetime

import structlog
from pydantic import ValidationError

from nmbus.delivery.replies import Replies
from nmbus.envelopes import IN_REPLY_TO_HEADER, REPLY_BY_HEADER, REQUESTER_HEADER
from nmbus.errors import MessageError
from nmbus.handlers import Registry
from nmbus.logs import per_message_logs
from nmbus.messages import Message, StoredMessage
from nmbus.ports.store import Outcomes
from nmbus.received import Received

log = structlog.get_logger("nmbus.worker")

# How long a reply for a request of another process of this endpoint waits
# before it is offered again (it is claimed at random by the endpoint's workers):
# 50 ms at first, growing with its age up to 5 s, so that the replies of a
# requester that died bounce slowly until their deadline.
HAND_BACK_DELAY = 0.05
HAND_BACK_MAX_DELAY = 5.0
# A reply is handed back for at most an hour after it was sent, whatever deadline
# its headers name: a live requester gets it within a few hand-backs, so after an
# hour its process is gone (or the deadline was forged) and the reply is late.
HAND_BACK_MAX_AGE = 3600.0


def _hand_back_delay(row: StoredMessage) -> float | None:
    """How long a reply waits before it is offered again; None when it is too old to."""
    age = (datetime.now(UTC) - row.insert_time).total_seconds()
    if age >= HAND_BACK_MAX_AGE:
        return None
    return min(HAND_BACK_MAX_DELAY, max(HAND_BACK_DELAY, age / 10))


def _not_yet(when: object) -> bool:
    """Whether ISO 8601 time ``when`` is still to come (False for anything unreadable)."""
    if not isinstance(when, str):
        return False
    try:
        moment = datetime.fromisoformat(when)
    except ValueError:
        return False
    if moment.tzinfo is None:
        return False
    return moment > datetime.now(UTC)


class ReplyRouting:
    """The replies that come in at one endpoint, and the requests of this process."""

    def __init__(self, registry: Registry, replies: Replies | None) -> None:
        self.registry = registry
        self.replies = replies
        # Rows of replies handed to their request: a batch run again (a conflict, a
        # split) must not hand one to its type's handlers as well.
        self._resolved: set[int] = set()

    def route(self, received: Received, cls: type[Message], outcomes: Outcomes) -> bool:
        """Deal with a reply if it is not for the handlers: True when its outcome is added."""
        row = received.row
        try:
            headers = received.headers
        except ValueError:
            return False
        if IN_REPLY_TO_HEADER not in headers:
            return False
        if row.id in self._resolved:
            outcomes.add(row.id, "X")  # its request has it: only its outcome was lost
            return True
        replies = self.replies
        if replies is not None and row.correlation_id in replies:
            try:
                message = self.registry.codec.decode(cls, row.msg_text or "", row.msg_headers)
            except (ValidationError, ValueError, MessageError):
                return False  # recorded as undecodable by the usual path
            if replies.resolve(row.correlation_id, message):
                if len(self._resolved) >= 10_000:
                    self._resolved.clear()  # bounded; a batch's own are its last few
                self._resolved.add(row.id)
                outcomes.add(row.id, "X")
                if per_message_logs():
                    log.info("reply_received", correlation_id=row.correlation_id)
                return True
        requester = headers.get(REQUESTER_HEADER)
        if (
            requester
            and replies is not None
            and requester != replies.client_id
            and _not_yet(headers.get(REPLY_BY_HEADER))
            and (delay := _hand_back_delay(row)) is not None
        ):
            outcomes.add(row.id, "R", delay=delay, correction=-1)
            return True
        if self.registry.handlers_for(cls):
            return False
        outcomes.add(
            row.id,
            "X",
            error_info=(
                f"late reply: no request waits for correlation id {row.correlation_id!r} "
                "any more (it timed out, or its process stopped) and no handler takes "
                f"{row.label}"
            ),
        )
        if per_message_logs():
            log.info("late_reply", correlation_id=row.correlation_id)
        return True
