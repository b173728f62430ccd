"""Retry policies: when to try a failed message again. Pure, no I/O."""

from __future__ import annotations

import contextlib
import math
import random
from dataclasses import dataclass

from nmbus.errors import MAX_SECONDS, InvalidSetting


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with a cap and optional jitter.

    ``max_attempts`` counts every attempt, the first included: with 3, a message
    is tried at most three times and then moved to F. The delay before attempt
    ``n + 1`` is ``initial_delay * backoff ** (n - 1)``, capped at ``max_delay``
    and spread by ``±jitter`` (a fraction).
    """

    max_attempts: int = 5
    initial_delay: float = 1.0
    backoff: float = 2.0
    max_delay: float = 300.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise InvalidSetting(f"max_attempts must be >= 1, got {self.max_attempts}")
        for name in ("initial_delay", "max_delay"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value <= MAX_SECONDS):
                raise InvalidSetting(
                    f"RetryPolicy {name}: retry delays must be >= 0 and finite, at most "
                    f"{MAX_SECONDS} seconds (10 years), got {value}"
                )
        if not (math.isfinite(self.backoff) and self.backoff >= 1):
            raise InvalidSetting(f"RetryPolicy backoff must be finite and >= 1, got {self.backoff}")
        if not 0 <= self.jitter < 1:
            raise InvalidSetting(f"RetryPolicy jitter must be in [0, 1), got {self.jitter}")

    @classmethod
    def of(cls, value: RetryPolicy | int | None, default: RetryPolicy | None = None) -> RetryPolicy:
        """Normalise ``retry=3`` / ``retry=RetryPolicy(...)`` / ``None`` to a policy."""
        if value is None:
            return default if default is not None else cls()
        if isinstance(value, RetryPolicy):
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"retry must be an int or a RetryPolicy, got {value!r}")
        base = default if default is not None else cls()
        return cls(
            max_attempts=value,
            initial_delay=base.initial_delay,
            backoff=base.backoff,
            max_delay=base.max_delay,
            jitter=base.jitter,
        )

    def gives_up_after(self, attempts: int) -> bool:
        """Whether a message that has used ``attempts`` attempts goes to F."""
        return attempts >= self.max_attempts

    def delay(self, attempts: int) -> float:
        """Seconds to wait after the ``attempts``-th failed attempt."""
        base = self.max_delay
        if self.initial_delay == 0:
            base = 0.0
        elif self.initial_delay < self.max_delay:
            # backoff ** n beyond a float raises OverflowError: the cap applies.
            with contextlib.suppress(OverflowError):
                base = min(base, self.initial_delay * self.backoff ** max(0, attempts - 1))
        if self.jitter:
            base *= 1 + random.uniform(-self.jitter, self.jitter)
        return max(0.0, base)
