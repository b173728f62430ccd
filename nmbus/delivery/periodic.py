"""Periodic messages: a :class:`Tick` into the endpoint's own queue at every due time.

``@bus.periodic(every=60.0)`` or ``@bus.periodic(cron="*/5 * * * *")`` registers
a schedule and its handler, ``async def sweep(tick: Tick, ctx: Context)``.
Every process that runs the endpoint's workers also runs its schedules, and
each of them tries to insert the tick of a due time. The store records the
latest due time enqueued per endpoint and schedule, in the same transaction as
the tick (:meth:`nmbus.ports.store.Store.insert_tick`), and inserts a tick only for a
due time later than that record: so a due time is enqueued once, however many
processes run, and also after retention removed the tick's row (the record is
never removed). The tick's unique id ``nmbus.tick:<name>:<due time>`` still
keeps one row per due time. Due times are worked out from the schedule alone
(multiples of ``every`` seconds since the epoch, or the cron expression's times,
in UTC), so every process names a due time the same way.

Missed ticks (the endpoint was down): with ``missed="last"`` (the default) a
process that starts, or wakes late, enqueues only the latest due time that has
passed, once; ``missed="skip"`` waits for the next due time instead.

Cron expressions are parsed by croniter: five fields, or six with seconds last;
one of any other length, or that never falls due (30 February), is refused at
registration. A schedule that fails at run time anyway is logged and left out,
never stopping the endpoint's other schedules.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import structlog
from croniter import CroniterBadCronError, CroniterBadDateError, croniter

from nmbus.context import Context
from nmbus.envelopes import EnvelopeBuilder, Outgoing
from nmbus.errors import MAX_SECONDS, ConfigurationError, HandlerError
from nmbus.logs import log_failure
from nmbus.messages import Envelope, Message
from nmbus.ports.store import Store

log = structlog.get_logger("nmbus.periodic")

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
TICK_ID_PREFIX = "nmbus.tick:"


class Tick(Message, type_name="nmbus.Tick"):
    """A periodic message: schedule ``name`` was due at ``scheduled_at`` (UTC)."""

    name: str
    scheduled_at: datetime


TickHandler = Callable[[Tick, Context], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Schedule:
    """When one periodic handler is due. Pure: no I/O, no clock of its own."""

    name: str
    func: TickHandler
    every: float | None = None
    cron: str | None = None
    missed: Literal["last", "skip"] = "last"

    @classmethod
    def of(
        cls,
        func: Any,
        every: float | None,
        cron: str | None,
        name: str | None,
        missed: str,
    ) -> Schedule:
        """Check everything at registration: one of every/cron, a valid name and handler."""
        if (every is None) == (cron is None):
            raise ConfigurationError("periodic: give every=seconds or cron='...', exactly one")
        if every is not None:
            if isinstance(every, bool) or not isinstance(every, int | float):
                raise ConfigurationError(f"periodic every must be seconds, got {every!r}")
            if not (math.isfinite(every) and 0.1 <= every <= MAX_SECONDS):
                raise ConfigurationError(
                    f"periodic every must be finite, at least 0.1 and at most {MAX_SECONDS} "
                    f"seconds, got {every}"
                )
        if cron is not None:
            _check_cron(cron)
        if missed not in ("last", "skip"):
            raise ConfigurationError(f"periodic missed must be 'last' or 'skip', got {missed!r}")
        if not inspect.iscoroutinefunction(func):
            raise HandlerError(f"periodic handler {func!r} must be an async function")
        params = list(inspect.signature(func).parameters.values())
        if len(params) != 2:
            raise HandlerError(
                f"periodic handler {func.__qualname__} must take exactly (tick, ctx)"
            )
        name = name if name is not None else func.__name__
        if not isinstance(name, str) or not name or len(name) > 100 or "\x00" in name:
            raise ConfigurationError(f"periodic name must be 1-100 characters, got {name!r}")
        return cls(name, func, float(every) if every is not None else None, cron, missed)  # type: ignore[arg-type]

    def latest(self, now: datetime) -> datetime:
        """The latest due time at or before ``now``."""
        if self.every is not None:
            # Whole microseconds, so every process names a due time identically.
            step = round(self.every * 1_000_000)
            since = (now - _EPOCH) // timedelta(microseconds=1)
            return _EPOCH + timedelta(microseconds=since - since % step)
        assert self.cron is not None
        if croniter.match(self.cron, now.replace(microsecond=0)) and now.microsecond == 0:
            return now
        found: datetime = croniter(self.cron, now).get_prev(datetime)
        return found

    def after(self, now: datetime) -> datetime:
        """The first due time strictly after ``now``."""
        if self.every is not None:
            step = timedelta(microseconds=round(self.every * 1_000_000))
            return self.latest(now) + step
        assert self.cron is not None
        found: datetime = croniter(self.cron, now).get_next(datetime)
        return found

    def unique_id(self, due: datetime) -> str:
        return f"{TICK_ID_PREFIX}{self.name}:{due.astimezone(UTC).isoformat()}"


def _check_cron(cron: object) -> None:
    """Refuse a cron expression croniter cannot read, of other than 5 or 6 fields
    (croniter also reads a 7th, the year, which nmbus does not promise), or that
    never falls due (``0 0 30 2 *``, 30 February): such a schedule would fail
    at every step of the scheduler instead of at registration."""
    if not isinstance(cron, str) or not croniter.is_valid(cron):
        raise ConfigurationError(f"periodic cron {cron!r} is not a valid cron expression")
    fields = len(cron.split())
    if fields not in (5, 6):
        raise ConfigurationError(
            f"periodic cron {cron!r} has {fields} fields: give five (minute hour day "
            "month weekday), or six with seconds last"
        )
    now = datetime.now(UTC)
    try:
        croniter(cron, now).get_next(datetime)
        croniter(cron, now).get_prev(datetime)
    except (CroniterBadDateError, CroniterBadCronError, ValueError, OverflowError):
        raise ConfigurationError(
            f"periodic cron {cron!r} never falls due (a day that no month has?)"
        ) from None


def tick_envelope(builder: EnvelopeBuilder, schedule: Schedule, due: datetime) -> Envelope:
    tick = Tick(name=schedule.name, scheduled_at=due)
    return builder.build(tick, Outgoing(unique_id=schedule.unique_id(due)))


def utcnow() -> datetime:
    return datetime.now(UTC)


class Scheduler:
    """Enqueues the ticks of an endpoint's schedules into its own queue, as they fall due."""

    def __init__(
        self,
        queue: str,
        store: Store,
        builder: EnvelopeBuilder,
        schedules: Sequence[Schedule],
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.queue = queue
        self.store = store
        self.builder = builder
        self.schedules = list(schedules)
        self.clock = clock

    async def enqueue(self, schedule: Schedule, due: datetime) -> bool:
        """Store the tick of ``due``; False when another process already did."""
        envelope = tick_envelope(self.builder, schedule, due)
        inserted = await self.store.insert_tick(self.queue, schedule.name, due, envelope)
        if inserted:
            log.debug("tick_enqueued", queue=self.queue, schedule=schedule.name, due=str(due))
        return inserted

    async def run(self) -> None:
        """Run until cancelled. A failed insert is logged and tried again at the next step.

        Each schedule is on its own: one whose due times cannot be worked out
        is logged (``periodic_schedule_failed``) and left out, never stopping
        the endpoint's other schedules.
        """
        now = self.clock()
        upcoming: dict[str, datetime] = {}
        by_name: dict[str, Schedule] = {}
        for schedule in self.schedules:
            try:
                latest = schedule.latest(now) if schedule.missed == "last" else None
                upcoming[schedule.name] = schedule.after(now)
            except Exception as exc:
                self._drop(schedule, exc)
                continue
            by_name[schedule.name] = schedule
            if latest is not None:
                await self._try(schedule, latest)
        while upcoming:
            soonest = min(upcoming.values())
            wait = (soonest - self.clock()).total_seconds()
            if wait > 0:
                await asyncio.sleep(wait)
            now = self.clock()
            for name, due in list(upcoming.items()):
                if due > now:
                    continue
                schedule = by_name[name]
                try:
                    # Woken late (a pause, a suspended host): the latest due time only.
                    latest = schedule.latest(now) if schedule.missed == "last" else due
                    following = schedule.after(now)
                except Exception as exc:
                    del upcoming[name]
                    self._drop(schedule, exc)
                    continue
                if await self._try(schedule, latest):
                    upcoming[name] = following

    def _drop(self, schedule: Schedule, exc: Exception) -> None:
        log_failure(log, "periodic_schedule_failed", exc, queue=self.queue, schedule=schedule.name)

    async def _try(self, schedule: Schedule, due: datetime) -> bool:
        try:
            await self.enqueue(schedule, due)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log_failure(log, "tick_enqueue_failed", exc, "warning", queue=self.queue)
            await asyncio.sleep(1.0)
            return False
        return True


def router(schedules: dict[str, Schedule]) -> Callable[[Tick, Context], Awaitable[None]]:
    """The one Tick handler of an endpoint: calls the handler of the tick's schedule."""

    async def route_tick(tick: Tick, ctx: Context) -> None:
        schedule = schedules.get(tick.name)
        if schedule is None:
            # A schedule removed from the code since the tick was enqueued.
            log.warning("tick_without_schedule", queue=ctx.queue, schedule=tick.name)
            return
        await schedule.func(tick, ctx)

    return route_tick
