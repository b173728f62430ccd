"""How many messages a worker loop claims at once, when ``batch_size`` is left unset.

A deep backlog drains fastest in big batches: one claim and one finish for
many messages. But the handlers of a batch run one after another, so a slow
handler makes every message behind it in its batch wait, and a batch claimed
whole holds all of its messages' leases. So each loop sizes its next claim
from its last batches, as TCP sizes its window: it starts at :data:`START`,
doubles while full batches finish within half of :data:`TARGET_SECONDS`, and
shrinks to what fits in that time when a batch takes longer, never above
:data:`MOST` nor below 1. No-op handlers reach :data:`MOST` within a few
batches; handlers of 10 ms settle at about 10 messages a claim, and handlers
of a second or more at 1, so no message waits behind a slow one for long.

A queue that is not deep does not need this: its claims take what is ready,
which is less than the limit. An explicit ``batch_size`` is a fixed size,
as before.
"""

from __future__ import annotations

#: The first claim of a loop.
START = 10
#: The most messages an adaptive claim takes.
MOST = 500
#: How long one batch should take, claim to finish, at most.
TARGET_SECONDS = 0.05


class BatchSizer:
    """The claim size of one worker loop: fixed, or adapted to its batches' times."""

    __slots__ = ("_adaptive", "limit")

    def __init__(self, batch_size: int | None) -> None:
        self._adaptive = batch_size is None
        self.limit = START if batch_size is None else batch_size

    def observe(self, size: int, seconds: float) -> None:
        """A batch of ``size`` messages took ``seconds`` from its claim to its finish."""
        if not self._adaptive or size <= 0:
            return
        if seconds > TARGET_SECONDS:
            fits = int(TARGET_SECONDS * size / seconds)
            self.limit = max(1, min(self.limit, fits))
        elif size >= self.limit and seconds < TARGET_SECONDS / 2:
            self.limit = min(MOST, self.limit * 2)
