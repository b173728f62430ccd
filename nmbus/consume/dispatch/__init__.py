"""Dispatch: one claimed message to its handlers, and what became of it.

For each message of a batch the worker asks the :class:`Dispatcher`, which
runs the handlers under their timeout with a :class:`~nmbus.context.Context`
and adds the message's outcome to the batch's :class:`~nmbus.ports.store.Outcomes`:
X, R after the retry policy's delay, or F, with a storable ``error_info``. It
writes nothing: the worker records every outcome of a batch in one statement.
The parts, each in its module:

- :mod:`.dispatcher`: the path of one message (is it for the handlers? run
  them; succeeded or failed), with the decoded message it is given
  (:class:`~nmbus.received.Received`: its type and headers, decoded once);
- :mod:`.transactions`: how a handler's writes share the batch's transaction
  (a savepoint each, the same under a lock, or none and a :class:`Replay`);
- :mod:`.failures`: what a failure leads to (R, F, or X when skipped);
- :mod:`.errorinfo`: how a failure is written down (``error_info``);
- :mod:`.replies`: where a reply goes when its type's handlers are not the place.
"""

from nmbus.consume.dispatch.dispatcher import Dispatcher, cancelled_from_outside
from nmbus.consume.dispatch.errorinfo import MAX_ERROR_INFO, because, describe, error_info, storable
from nmbus.consume.dispatch.failures import MAX_DELAY, MAX_FREE_CONFLICTS, Failures
from nmbus.consume.dispatch.replies import HAND_BACK_DELAY, HAND_BACK_MAX_AGE, HAND_BACK_MAX_DELAY
from nmbus.consume.dispatch.transactions import Replay, Savepoints, SerialBatch, Unguarded
from nmbus.logs import debug_enabled, per_message_logs

__all__ = [
    "HAND_BACK_DELAY",
    "HAND_BACK_MAX_AGE",
    "HAND_BACK_MAX_DELAY",
    "MAX_DELAY",
    "MAX_ERROR_INFO",
    "MAX_FREE_CONFLICTS",
    "Dispatcher",
    "Failures",
    "Replay",
    "Savepoints",
    "SerialBatch",
    "Unguarded",
    "because",
    "cancelled_from_outside",
    "debug_enabled",
    "describe",
    "error_info",
    "per_message_logs",
    "storable",
]
