"""Registration: what an endpoint declares before it runs.

Handlers (``@bus.handler``), sagas (``bus.saga``), periodic handlers
(``@bus.periodic``), subscriptions (``bus.subscribe``), the types it
publishes and sends (``bus.publishes``, ``bus.sends``: for its contract
document, ``nmbus asyncapi``), and the middleware around every message
handled (``@bus.middleware``) or sent (``@bus.outgoing``). Each is checked
when it is declared: misuse fails at registration, loudly, not at the first
message.

These are methods of :class:`~nmbus.Bus` (this class is its base), kept in
their own module; the Bus sets the attributes named here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, overload

from nmbus.delivery.flow import Limits
from nmbus.delivery.periodic import Schedule, Tick, TickHandler, router
from nmbus.delivery.subscriptions import Subscriptions
from nmbus.envelopes import EnvelopeBuilder
from nmbus.errors import ConfigurationError
from nmbus.handlers import HandlerFunc, Registry
from nmbus.messages import Message, type_name
from nmbus.middleware import Link
from nmbus.names import validate_queue_name
from nmbus.ports.store import Store
from nmbus.retry import RetryPolicy
from nmbus.sagas.saga import S, Saga

F = TypeVar("F", bound=HandlerFunc)
L = TypeVar("L", bound=Link)
U = TypeVar("U", bound=Callable[[dict[str, Any]], dict[str, Any]])


@dataclass(slots=True)
class OutgoingTypes:
    """The message types an endpoint declares it publishes and sends, by type name.

    What its contract document (``nmbus asyncapi``) lists as its send
    operations. Nothing else reads them: a publish or a send of a type left
    out is not refused, it is only missing from the document.
    """

    published: dict[str, type[Message]] = field(default_factory=dict)
    #: By (queue, type name).
    sent: dict[tuple[str, str], type[Message]] = field(default_factory=dict)


def _declared_types(what: str, message_types: tuple[type[Message], ...]) -> None:
    if not message_types:
        raise ConfigurationError(f"{what}() needs at least one Message subclass")
    for cls in message_types:
        if not (isinstance(cls, type) and issubclass(cls, Message)) or cls is Message:
            raise ConfigurationError(f"{what}() takes Message subclasses, got {cls!r}")


class Registration:
    """The declaring side of a Bus: handlers, sagas, periodic handlers, subscriptions,
    outgoing types."""

    endpoint: str
    store: Store
    registry: Registry
    envelopes: EnvelopeBuilder
    subscriptions: Subscriptions
    sagas: dict[str, Saga[Any]]
    outgoing_types: OutgoingTypes
    _schedules: dict[str, Schedule]
    # Periodic handlers are registered before the bus starts.
    _started: bool

    @overload
    def handler(self, func: F, /) -> F: ...

    @overload
    def handler(
        self,
        message: type[Message] | None = None,
        /,
        *,
        retry: RetryPolicy | int | None = None,
        timeout: float | None = None,
        outside_effects: bool = True,
        concurrency: int | None = None,
        rate: float | None = None,
        group_concurrency: int | None = None,
    ) -> Callable[[F], F]: ...

    def handler(
        self,
        target: Any = None,
        /,
        *,
        retry: RetryPolicy | int | None = None,
        timeout: float | None = None,
        outside_effects: bool = True,
        concurrency: int | None = None,
        rate: float | None = None,
        group_concurrency: int | None = None,
    ) -> Any:
        """Register an async handler; the message type comes from its annotation.

        ``@bus.handler``, ``@bus.handler(retry=3, timeout=10)`` or
        ``@bus.handler(SomeMessage)`` all work.

        ``outside_effects=False`` declares that the handler's only effects go
        through ``ctx.connection``, ``ctx.send``, ``ctx.publish`` and
        ``ctx.reply`` (no HTTP call, no file, no other database): a batch of
        such messages then runs without a savepoint per message, and when one
        of them fails after writing, the batch is rolled back and run again
        with savepoints. The replayed handlers run twice, but nothing of their
        first run was ever visible (docs/handlers.md).

        ``concurrency`` (most of its messages running at once), ``rate`` (most
        starts per second) and ``group_concurrency`` (most running at once per
        group of ``send(..., group=...)``) hold for every process and loop of
        the endpoint together (docs/flow-control.md).
        """
        limits = Limits.of(concurrency, rate, group_concurrency)
        if target is not None and not isinstance(target, type):
            self.registry.add(target, None, retry, timeout, outside_effects, limits)
            return target
        message_type = target

        def register(func: F) -> F:
            self.registry.add(func, message_type, retry, timeout, outside_effects, limits)
            return func

        return register

    def middleware(self, func: L, /) -> L:
        """Run ``async def m(msg, ctx, call_next) -> None`` around every handling.

        Inside the message's transaction, around its handlers: ``await
        call_next()`` runs the next middleware (registration order: the first
        registered is outermost) and then the handlers. What it raises, before
        or after ``call_next``, fails the message as a handler's exception
        would (retry, F, ``error_info``); context variables it sets are seen by
        the handlers; one that returns without calling ``call_next`` leaves the
        message processed (X) without its handlers. Calling it twice is an
        error. Registered before the bus starts (ConfigurationError after).
        See docs/middleware.md.
        """
        self._before_start("middleware")
        self.registry.add_middleware(func)
        return func

    def outgoing(self, func: L, /) -> L:
        """Run ``async def h(msg, headers, call_next) -> None`` around every outgoing message.

        Sends, publishes, requests, replies, saga timeouts and what handlers
        send, before the envelope is built: ``headers`` is a mutable dict of
        str to str (nmbus's own ``nmbus-*`` headers are not in it and cannot
        be set); ``await call_next()`` goes on to the next hook and the send.
        Raising (InvalidMessage, say) refuses the message; a hook that returns
        without calling ``call_next`` makes the send raise InvalidMessage.
        Registration order is call order; registered before the bus starts.
        See docs/middleware.md.
        """
        self._before_start("outgoing hooks")
        self.envelopes.add_hook(func)
        return func

    def upcaster(self, type_name: str, /, *, from_version: int) -> Callable[[U], U]:
        """Register ``def f(body: dict) -> dict`` making a stored ``type_name`` body of
        ``from_version`` into one of the next version, before it is validated.

        Chains run in order up to the class's ``version=`` wherever a body is
        decoded (worker, saga locks, replies, HandlerTest). A second upcaster
        of the same step, or one from the class's version or later, is a
        ConfigurationError. Registered before the bus starts. See
        docs/messages.md, "Versions and upcasters".
        """

        def register(func: U) -> U:
            self._before_start("upcasters")
            self.registry.codec.versions.add(type_name, from_version, func)
            return func

        return register

    def _before_start(self, what: str) -> None:
        if self._started:
            raise ConfigurationError(
                f"register {what} before the bus starts: endpoint {self.endpoint!r} is running"
            )

    def saga(
        self,
        state: type[S],
        key: str | Callable[[Any], object],
        *,
        name: str | None = None,
        on_missing: str = "fail",
    ) -> Saga[S]:
        """Declare a saga whose state is the pydantic model ``state``, kept in this endpoint.

        ``key`` names the field of its messages that identifies one saga (or is
        a callable of the message). ``name`` (default: the model's class name)
        is what the saga table stores; two sagas of an endpoint need two names.
        ``on_missing="ignore"`` sends a non-start message for a missing saga
        to X instead of F. Register handlers with ``@saga.handler``.
        """
        saga_name = name if name is not None else state.__name__
        if saga_name in self.sagas:
            raise ConfigurationError(
                f"endpoint {self.endpoint!r} already has a saga named {saga_name!r}; "
                "give this one name=..."
            )
        saga = Saga(
            state,
            key,
            name=saga_name,
            endpoint=self.endpoint,
            registry=self.registry,
            store=self.store,
            on_missing=on_missing,
        )
        self.sagas[saga_name] = saga
        return saga

    def periodic(
        self,
        *,
        every: float | None = None,
        cron: str | None = None,
        name: str | None = None,
        missed: Literal["last", "skip"] = "last",
    ) -> Callable[[TickHandler], TickHandler]:
        """Register ``async def handler(tick: Tick, ctx)``, run once per due time.

        ``every`` seconds (due at multiples of it since the epoch) or ``cron``
        (five fields, or six with seconds last; UTC). However many processes
        run this endpoint, each due time's tick is stored once (its unique id is
        the schedule's ``name``, default the function's name, plus the due time)
        and handled like any message of the endpoint. After downtime,
        ``missed="last"`` enqueues the latest missed due time once;
        ``missed="skip"`` waits for the next one. See docs/delivery.md.
        """

        def register(func: TickHandler) -> TickHandler:
            if self._started:
                raise ConfigurationError("register periodic handlers before the bus starts")
            schedule = Schedule.of(func, every, cron, name, missed)
            if schedule.name in self._schedules:
                raise ConfigurationError(
                    f"periodic schedule {schedule.name!r} is registered twice; give name=..."
                )
            if not self._schedules:
                self.registry.add(router(self._schedules), Tick)
            self._schedules[schedule.name] = schedule
            return func

        return register

    def subscribe(
        self, message_type: type[Message], publisher: str, *, permanent: bool = False
    ) -> None:
        """Receive ``message_type`` (and its subclasses) published by endpoint ``publisher``.

        Declare it before the bus starts; ``async with bus:`` writes the
        subscription, which expires ``settings.subscription_ttl`` seconds after
        the last renewal (renewed every ttl/3 while the bus runs). With
        ``permanent=True`` (or ``subscription_ttl=None``) it never expires and
        only :meth:`unsubscribe` removes it.
        """
        self.subscriptions.add(message_type, publisher, permanent)

    def publishes(self, *message_types: type[Message]) -> None:
        """Declare that this endpoint publishes ``message_types``, for its contract document.

        ``nmbus asyncapi`` lists each as a send operation on the channel of
        this endpoint's publications. Only the document reads it: ``publish``
        needs no declaration and checks none.
        """
        _declared_types("publishes", message_types)
        for cls in message_types:
            self.outgoing_types.published[type_name(cls)] = cls

    def sends(self, *message_types: type[Message], to: str) -> None:
        """Declare that this endpoint sends ``message_types`` to queue ``to``, for its
        contract document (``nmbus asyncapi``: a send operation on that queue's channel).

        As with :meth:`publishes`, ``send`` needs no declaration and checks none.
        """
        _declared_types("sends", message_types)
        queue = validate_queue_name(to)
        for cls in message_types:
            self.outgoing_types.sent[(queue, type_name(cls))] = cls

    async def unsubscribe(self, message_type: type[Message], publisher: str) -> None:
        """Stop receiving ``message_type`` from ``publisher``: delete the subscription rows.

        Before start, the rows are deleted when the bus starts.
        """
        await self.subscriptions.remove(message_type, publisher)
