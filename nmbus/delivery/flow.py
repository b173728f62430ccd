"""Flow control: limits on a handler's messages in flight and started per second.

``@bus.handler(concurrency=5, rate=100.0, group_concurrency=1)`` declares the
limits of one handler (DESIGN.md section 10). They hold for every process and
loop of the endpoint together, because they are enforced where messages are
claimed (nmbus/postgres/flow.py): a claim takes a limited message only while
its handler's limits have room, and the messages it holds back stay in I/R,
where the messages of other types and other groups flow past them.

A handler's limits count the messages of its class and of every subclass known
when the worker starts (their type names, the queue's ``label``). A message
handled by two limited handlers counts against both.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any

from nmbus.errors import HandlerError
from nmbus.names import check_key

#: The longest group key, in UTF-8 bytes (it is read from every ready row a
#: limited claim looks at, and names a group in the flights table's rows).
MAX_GROUP_KEY = 200
#: The highest limit accepted: beyond it a limit limits nothing.
MAX_LIMIT = 1_000_000
#: The lowest rate accepted: one start a day.
MIN_RATE = 1 / 86400
#: The header that carries a message's group.
GROUP_HEADER = "nmbus-group"


def check_group(group: object) -> str:
    """Refuse a group key that is not a non-empty str of at most MAX_GROUP_KEY bytes."""
    return check_key("group", group, MAX_GROUP_KEY)


def _count(what: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise HandlerError(f"{what} must be a whole number of messages, got {value!r}")
    if not 1 <= value <= MAX_LIMIT:
        raise HandlerError(f"{what} must be from 1 to {MAX_LIMIT:,}, got {value}")
    return value


def _rate(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise HandlerError(f"rate must be a number of starts per second, got {value!r}")
    rate = float(value)
    if not (math.isfinite(rate) and MIN_RATE <= rate <= MAX_LIMIT):
        raise HandlerError(
            f"rate must be a finite number of starts per second from {MIN_RATE:.3g} (one "
            f"a day) to {MAX_LIMIT:,}, got {value!r}"
        )
    return rate


@dataclass(frozen=True, slots=True)
class Limits:
    """The limits of one handler; None: no limit of that kind."""

    concurrency: int | None = None
    rate: float | None = None
    group_concurrency: int | None = None

    @classmethod
    def of(cls, concurrency: object, rate: object, group_concurrency: object) -> Limits | None:
        """Check what the decorator was given; None when it declares no limit."""
        limits = cls(
            _count("concurrency", concurrency),
            _rate(rate),
            _count("group_concurrency", group_concurrency),
        )
        return None if limits == cls() else limits

    @property
    def window(self) -> tuple[int, float] | None:
        """The rate as whole starts per sliding window of seconds, or None.

        At least one second, so that every one-second window holds at most
        ``rate`` starts: 100.0 is 100 starts in any 1 s; 2.5 is 2 in any 1 s;
        0.5 is 1 in any 2 s.
        """
        if self.rate is None:
            return None
        if self.rate >= 1:
            return int(self.rate), 1.0
        return 1, 1.0 / self.rate

    def describe(self) -> str:
        parts = []
        if self.concurrency is not None:
            parts.append(f"concurrency={self.concurrency}")
        if self.rate is not None:
            parts.append(f"rate={self.rate:g}/s")
        if self.group_concurrency is not None:
            parts.append(f"group_concurrency={self.group_concurrency}")
        return ", ".join(parts)


@dataclass(frozen=True)
class FlowLimits:
    """Every limit of an endpoint, as the claim takes them: keys, and the labels of each."""

    limits: dict[str, Limits]
    labels: dict[str, tuple[str, ...]]
    #: How many handlers a worker loop runs at once (handler_concurrency).
    at_once: int = 1

    @classmethod
    def of(
        cls, handlers: Iterable[tuple[str, Limits, Iterable[str]]], at_once: int = 1
    ) -> FlowLimits | None:
        """From (handler name, limits, labels it handles); None when no handler has limits."""
        limits: dict[str, Limits] = {}
        labels: dict[str, tuple[str, ...]] = {}
        for key, found, names in handlers:
            limits[key] = found
            labels[key] = tuple(sorted(set(names)))
        return cls(limits, labels, at_once) if limits else None

    def label_pairs(self) -> tuple[list[str], list[str]]:
        """Parallel arrays (label, key): which limits each label counts against."""
        pairs = [(label, key) for key, names in self.labels.items() for label in names]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def arrays(self) -> tuple[list[Any], ...]:
        """Parallel arrays per key: key, concurrency, the rate's starts and window
        (seconds), group_concurrency."""
        keys = sorted(self.limits)
        windows = [self.limits[k].window for k in keys]
        return (
            keys,
            [self.limits[k].concurrency for k in keys],
            [w[0] if w else None for w in windows],
            [w[1] if w else 1.0 for w in windows],
            [self.limits[k].group_concurrency for k in keys],
        )

    def described(self) -> dict[str, str]:
        """Each key's limits as text (``concurrency=5, rate=100/s``)."""
        return {key: limit.describe() for key, limit in self.limits.items()}

    @cached_property
    def rated_keys(self) -> list[str]:
        """The handlers with a rate: their starts are marked (StartMarks)."""
        return sorted(key for key, limit in self.limits.items() if limit.rate is not None)

    @property
    def longest_window(self) -> float:
        windows = (w[1] for limit in self.limits.values() if (w := limit.window))
        return max(windows, default=1.0)


@dataclass(frozen=True, slots=True)
class LimitStatus:
    """One handler's limits as last declared, and what they hold now (flow_status)."""

    queue: str
    handler: str  # its limit key: "<message type>:<function>"
    limits: str  # as declared: "concurrency=5, rate=100/s"
    declared_by: str  # the worker (client id) that declared them last
    declared_at: datetime
    in_flight: int  # its messages still leased by the claim that took them
    started: int | None  # starts in its rate's window now (None: no rate)
    waiting: int  # ready messages of its types that no worker holds
    held_back: int  # of those, the ones its limits hold back now
