"""Envelopes: a message made ready for its queue table. No I/O of its own.

Everything that sending checks happens here, before anything is written: the
endpoint's outgoing hooks (``@bus.outgoing``) have their say, the body is
encoded and measured, headers and ids must be storable text, the delivery time
is worked out, and a published message carries its type chain.
The Bus and a handler's Context build envelopes through the same
:class:`EnvelopeBuilder`, so a send from a handler and one from application
code are checked alike.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypedDict

from nmbus.contracts import Codec
from nmbus.delivery.flow import GROUP_HEADER, check_group
from nmbus.errors import MAX_SECONDS, InvalidMessage, MessageTooLarge
from nmbus.messages import Envelope, Message, lookup_type, type_chain
from nmbus.middleware import Link, checked, name_of, run_chain
from nmbus.names import MAX_SEQUENCE_KEY as MAX_SEQUENCE_KEY
from nmbus.names import check_key, check_text, utf8_size, validate_queue_name

#: Header carrying a published message's type chain, most specific first,
#: comma-separated; present when the message's class has Message ancestors.
TYPE_CHAIN_HEADER = "nmbus-type-chain"

#: Headers whose name starts with this belong to one message and never travel
#: onto what its handler sends (see :func:`travelling`).
INTERNAL_PREFIX = "nmbus-"
#: On a saga timeout: the saga's name and key, so the timeout finds its saga,
#: and the saga instance that set it (a timeout acts on that instance only).
SAGA_HEADER = "nmbus-saga"
SAGA_KEY_HEADER = "nmbus-saga-key"
SAGA_INSTANCE_HEADER = "nmbus-saga-instance"
#: Where the answer to a message goes (``ctx.reply``): an endpoint name.
REPLY_TO_HEADER = "nmbus-reply-to"
#: On a reply: the unique id of the message it answers.
IN_REPLY_TO_HEADER = "nmbus-in-reply-to"
#: On a request, copied onto its reply: the client id of the process waiting
#: for it and until when (ISO 8601), so that another process of the same
#: endpoint hands the reply back rather than take it for a late one.
REQUESTER_HEADER = "nmbus-requester"
REPLY_BY_HEADER = "nmbus-reply-by"


def travelling(headers: Mapping[str, str]) -> dict[str, str]:
    """The headers of a handled message that go onto what its handler sends.

    All but nmbus's own (``nmbus-*``), which describe one message only: its
    type chain, saga, reply address.
    """
    return {
        k: v
        for k, v in headers.items()
        if isinstance(v, str) and k[: len(INTERNAL_PREFIX)].lower() != INTERNAL_PREFIX
    }


def user_headers(headers: object) -> Mapping[str, str] | None:
    """The headers a caller gives ``send``, ``publish``, ``request`` or ``reply``, checked.

    A mapping of str to str, with no name of nmbus's own (``nmbus-*``, in any
    case): those steer delivery (a reply's requester, its reply-by time, a
    saga's key) and only nmbus sets them. Refused with InvalidMessage.
    """
    if headers is None:
        return None
    if not isinstance(headers, Mapping):
        raise InvalidMessage(
            f"headers must be a mapping of str to str (a dict), got {type(headers).__name__}"
        )
    for key in headers:
        if isinstance(key, str) and key[: len(INTERNAL_PREFIX)].lower() == INTERNAL_PREFIX:
            raise InvalidMessage(
                f"header {key[:60]!r}: names starting with {INTERNAL_PREFIX!r} are reserved "
                "for nmbus's own headers"
            )
    return headers


def check_connection(connection: object) -> None:
    """Refuse a ``connection=`` that is not an asyncpg connection (InvalidMessage)."""
    if connection is not None and not (
        hasattr(connection, "fetchrow") and hasattr(connection, "is_in_transaction")
    ):
        raise InvalidMessage(
            "connection must be an asyncpg connection (in a transaction), "
            f"got {type(connection).__name__}"
        )


def type_name(message: object) -> str:
    """The type name of ``message``, or its class name if it is not a Message (for spans)."""
    return str(getattr(message, "__type_name__", type(message).__name__))


def chain_header(cls: type[Message]) -> str | None:
    """The TYPE_CHAIN_HEADER value for ``cls``, or None when it is its own whole chain."""
    chain = type_chain(cls)
    return ",".join(chain) if len(chain) > 1 else None


def chain_of(envelope: Envelope) -> str:
    """The comma-separated type chain of a published envelope (its label alone if no header)."""
    text = envelope.msg_headers
    if text and TYPE_CHAIN_HEADER in text:
        value = json.loads(text).get(TYPE_CHAIN_HEADER)
        if isinstance(value, str) and value:
            return value
    return envelope.label


def decode_type(label: str | None, msg_headers: str | None) -> type[Message] | None:
    """The class to decode a stored message as: its own type, else the nearest known ancestor.

    A subscriber to a base class may receive a subclass that its code base does
    not define; the publisher's type-chain header names the ancestors, and the
    first one known here is used (pydantic ignores the fields it does not know).
    """
    cls = lookup_type(label) if label else None
    if cls is not None or not msg_headers or TYPE_CHAIN_HEADER not in msg_headers:
        return cls
    try:
        chain = json.loads(msg_headers).get(TYPE_CHAIN_HEADER)
    except (ValueError, AttributeError):
        return None
    return nearest_known(chain)


def nearest_known(chain: object) -> type[Message] | None:
    """The first class known here of a TYPE_CHAIN_HEADER value (None for anything else)."""
    if not isinstance(chain, str):
        return None
    for name in chain.split(","):
        found = lookup_type(name)
        if found is not None:
            return found
    return None


def check_delay(deliver_at: datetime | None, delay: float | None) -> float | None:
    """Check when a message becomes ready (``deliver_at`` or ``delay`` seconds, not both);
    the delay, or None when there is none (the envelope builder adds it to its clock)."""
    if deliver_at is not None and delay is not None:
        raise InvalidMessage("give deliver_at or delay, not both")
    if delay is not None:
        if isinstance(delay, bool) or not isinstance(delay, int | float):
            raise InvalidMessage(f"delay must be a number of seconds, got {type(delay).__name__}")
        if not (math.isfinite(delay) and 0 <= delay <= MAX_SECONDS):
            raise InvalidMessage(
                f"delay must be >= 0 seconds and finite, at most {MAX_SECONDS} "
                f"(10 years), got {delay}"
            )
        return delay or None
    if deliver_at is not None and (
        not isinstance(deliver_at, datetime) or deliver_at.tzinfo is None
    ):
        raise InvalidMessage("deliver_at must be a timezone-aware datetime (datetime.now(UTC))")
    return None


#: Headers of a message whose body is stored apart (the claim check, docs/messages.md):
#: the key of its payload, and the payload's size in bytes. The store that writes
#: the row sets them; a consumer puts the body back before anything reads it.
CLAIM_CHECK_HEADER = "nmbus-claim-check"
CLAIM_CHECK_BYTES_HEADER = "nmbus-claim-check-bytes"
#: The largest body the claim check stores apart (PostgreSQL's text ends at 1 GiB).
MAX_CLAIM_CHECK_BYTES = 256 * 1024 * 1024


def apart_headers(headers: str | None) -> dict[str, Any] | None:
    """The headers of a row (its JSON text) whose body is stored apart (the claim
    check's key under CLAIM_CHECK_HEADER), parsed; None for any other row."""
    if headers is None or CLAIM_CHECK_HEADER not in headers:
        return None
    try:
        loaded = json.loads(headers)
    except ValueError:
        return None
    if not isinstance(loaded, dict) or not isinstance(loaded.get(CLAIM_CHECK_HEADER), str):
        return None
    return loaded


def stored_apart(headers: str | None) -> str | None:
    """What an operator sees in place of a body stored apart (``headers``: a row's
    JSON text): ``[stored apart: <bytes> bytes, key <key>]``; None for any other row."""
    loaded = apart_headers(headers)
    if loaded is None:
        return None
    size = loaded.get(CLAIM_CHECK_BYTES_HEADER, "?")
    return f"[stored apart: {size} bytes, key {loaded[CLAIM_CHECK_HEADER]}]"


#: Headers of a failure port's copy (``Bus(dead_letter=...)``): where the original
#: is (queue and row id: it stays there, in F), its unique id and why it failed.
FAILED_QUEUE_HEADER = "nmbus-failed-queue"
FAILED_ID_HEADER = "nmbus-failed-id"
FAILED_UNIQUE_ID_HEADER = "nmbus-failed-unique-id"
FAILED_ERROR_HEADER = "nmbus-failed-error"


# What routes a message to a waiting request or to a saga instance: a copy in the
# failure port is neither.
_NOT_COPIED_TO_PORT = frozenset(
    {
        IN_REPLY_TO_HEADER,
        REQUESTER_HEADER,
        REPLY_BY_HEADER,
        SAGA_HEADER,
        SAGA_KEY_HEADER,
        SAGA_INSTANCE_HEADER,
    }
)


def dead_letter_copy(
    queue: str,
    id: int,
    unique_id: str,
    label: str | None,
    msg_text: str | None,
    msg_headers: str | None,
    correlation_id: str | None,
    error: str | None,
) -> Envelope | None:
    """The copy of a row that landed in F, for the failure port: same body, type and
    headers, plus the FAILED_* headers (the error is its first line, as error_info's).

    None when the row is itself a failure port's copy (it has FAILED_QUEUE_HEADER):
    a copy of a copy is never made, so failure ports that point at each other,
    in a cycle of any length, stop after one copy instead of copying for ever.

    The copy is nobody's reply and no saga's timeout: the headers that would make
    the port's workers hand it to a request, or back to another process of their
    endpoint, or to a saga of the same name, are not copied.
    """
    headers: dict[str, str] = {}
    if msg_headers:
        try:
            loaded = json.loads(msg_headers)
        except ValueError:
            loaded = {}
        if isinstance(loaded, dict):
            if FAILED_QUEUE_HEADER in loaded:
                return None
            headers = {
                str(k): str(v) for k, v in loaded.items() if str(k) not in _NOT_COPIED_TO_PORT
            }
    # A body stored apart is copied whole (the consumer put it back), and stored
    # apart again under a key of its own: the original's payload goes with it.
    apart = headers.pop(CLAIM_CHECK_HEADER, None) is not None
    headers.pop(CLAIM_CHECK_BYTES_HEADER, None)
    headers[FAILED_QUEUE_HEADER] = queue
    headers[FAILED_ID_HEADER] = str(id)
    headers[FAILED_UNIQUE_ID_HEADER] = unique_id
    headers[FAILED_ERROR_HEADER] = (error or "").split("\n", 1)[0]
    return Envelope(
        label=label or "",
        msg_text=msg_text or "",
        msg_headers=json.dumps(headers, ensure_ascii=False),
        unique_id=uuid.uuid4().hex,
        correlation_id=correlation_id,
        deliver_at=None,
        apart=apart,
    )


#: Priorities a message may have: higher is claimed first, 0 by default.
MIN_PRIORITY, MAX_PRIORITY = -100, 100


@dataclass(frozen=True, slots=True)
class Delivery:
    """Checked delivery controls of one message (docs/delivery.md)."""

    priority: int = 0
    sequence: str | None = None
    expires_at: datetime | None = None


PLAIN = Delivery()


def delivery(
    priority: int = 0,
    sequence: str | None = None,
    ttl: float | None = None,
    expires_at: datetime | None = None,
) -> Delivery:
    """Check ``priority``, ``sequence`` and the expiry (``ttl`` seconds or ``expires_at``).

    Refused with :class:`InvalidMessage`: a priority that is not an int in
    MIN_PRIORITY..MAX_PRIORITY, an empty or over-long sequence key, a ttl that is
    not a finite number of seconds > 0 (at most 10 years), a naive expires_at, or
    both ttl and expires_at.
    """
    if priority == 0 and sequence is None and ttl is None and expires_at is None:
        return PLAIN
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidMessage(f"priority must be an int, got {type(priority).__name__}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidMessage(
            f"priority must be between {MIN_PRIORITY} and {MAX_PRIORITY}, got {priority}"
        )
    if sequence is not None:
        check_key("sequence key", sequence, MAX_SEQUENCE_KEY)
    if ttl is not None and expires_at is not None:
        raise InvalidMessage("give ttl or expires_at, not both")
    if ttl is not None:
        if isinstance(ttl, bool) or not isinstance(ttl, int | float):
            raise InvalidMessage(f"ttl must be a number of seconds, got {type(ttl).__name__}")
        if not (math.isfinite(ttl) and 0 < ttl <= MAX_SECONDS):
            raise InvalidMessage(
                f"ttl must be > 0 seconds and finite, at most {MAX_SECONDS} (10 years), "
                f"got {ttl}; leave it out for a message that never expires"
            )
        expires_at = datetime.now(UTC) + timedelta(seconds=ttl)
    elif expires_at is not None and (
        not isinstance(expires_at, datetime) or expires_at.tzinfo is None
    ):
        raise InvalidMessage("expires_at must be a timezone-aware datetime")
    return Delivery(priority, sequence, expires_at)


class PublishOptions(TypedDict, total=False):
    """The options of a publish, by ``Bus.publish`` or a handler's ``ctx.publish``.

    Declared here once: both take them as keyword arguments and check them with
    :func:`outgoing`. What each means and what is refused: ``Bus.send``'s
    docstring and docs/delivery.md.
    """

    headers: Mapping[str, str] | None
    unique_id: str | None
    unique_while: str | None
    unique_for: float | None
    correlation_id: str | None
    deliver_at: datetime | None
    delay: float | None
    priority: int
    sequence: str | None
    ttl: float | None
    expires_at: datetime | None


class SendOptions(PublishOptions, total=False):
    """The options of a send (``Bus.send``, ``ctx.send``): a publish's, and two more.

    ``reply_to`` names the endpoint the receiver's ``ctx.reply`` answers to;
    ``group`` is the key the receiver's ``group_concurrency`` counts per.
    """

    reply_to: str | None
    group: str | None


SEND_OPTIONS = frozenset(SendOptions.__annotations__)
PUBLISH_OPTIONS = frozenset(PublishOptions.__annotations__)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """Checked options of one send or publish: what the envelope builder takes."""

    headers: Mapping[str, str] | None = None
    unique_id: str | None = None
    correlation_id: str | None = None
    deliver_at: datetime | None = None
    controls: Delivery = PLAIN
    #: Seconds from when the envelope is built (its builder's clock), instead of deliver_at.
    delay: float | None = None

    def with_headers(self, headers: Mapping[str, str] | None) -> Outgoing:
        return self if headers is self.headers else replace(self, headers=headers)

    def marked(self, marks: Mapping[str, str]) -> Outgoing:
        """These options with nmbus's own headers added (a request's, a reply's, a saga's)."""
        return replace(self, headers={**(self.headers or {}), **marks})


NO_OPTIONS = Outgoing()


def outgoing(options: Mapping[str, Any], call: str = "send") -> Outgoing:
    """Check a send's or a publish's options (``call`` names which), before anything is written.

    An option that ``call`` does not take is a TypeError, as for any function;
    the rest are refused with InvalidMessage as ``Bus.send`` says.
    """
    if not options:
        return NO_OPTIONS
    allowed = SEND_OPTIONS if call == "send" else PUBLISH_OPTIONS
    unknown = options.keys() - allowed
    if unknown:
        raise TypeError(f"{call}() got an unexpected keyword argument {min(unknown)!r}")
    headers = user_headers(options.get("headers"))
    reply_to, group = options.get("reply_to"), options.get("group")
    if reply_to is not None or group is not None:
        marks = {}
        if reply_to is not None:
            marks[REPLY_TO_HEADER] = validate_queue_name(reply_to)
        if group is not None:
            marks[GROUP_HEADER] = check_group(group)
        headers = {**(headers or {}), **marks}
    window = unique_window(options)
    if window:
        headers = {**(headers or {}), **window}
    deliver_at = options.get("deliver_at")
    delay = check_delay(deliver_at, options.get("delay"))
    return Outgoing(
        headers,
        options.get("unique_id"),
        options.get("correlation_id"),
        deliver_at,
        delivery(
            options.get("priority", 0),
            options.get("sequence"),
            options.get("ttl"),
            options.get("expires_at"),
        ),
        delay,
    )


#: The window of a unique_id (docs/messages.md, "Unique windows"), read by the
#: queue's unique table: held while the message is in I or R, or for N seconds.
UNIQUE_WHILE_HEADER = "nmbus-unique-while"
UNIQUE_FOR_HEADER = "nmbus-unique-for"
#: The longest unique_for: ten years, in seconds.
MAX_UNIQUE_FOR = 10 * 366 * 86400


def unique_window(options: Mapping[str, Any]) -> dict[str, str]:
    """The headers of a send's unique window, or none; InvalidMessage if it is wrong."""
    while_, for_ = options.get("unique_while"), options.get("unique_for")
    if while_ is None and for_ is None:
        return {}
    if options.get("unique_id") is None:
        raise InvalidMessage("unique_while and unique_for need a unique_id")
    if while_ is not None and for_ is not None:
        raise InvalidMessage("give unique_while or unique_for, not both")
    if while_ is not None:
        if while_ != "pending":
            raise InvalidMessage(f"unique_while must be 'pending', got {str(while_)[:40]!r}")
        return {UNIQUE_WHILE_HEADER: "pending"}
    if (
        isinstance(for_, bool)
        or not isinstance(for_, (int, float))
        or not math.isfinite(for_)
        or not 0 < for_ <= MAX_UNIQUE_FOR
    ):
        raise InvalidMessage(
            f"unique_for must be a number of seconds above 0 and at most {MAX_UNIQUE_FOR}, "
            f"got {str(for_)[:40]!r}"
        )
    return {UNIQUE_FOR_HEADER: repr(float(for_))}


def _utc_now() -> datetime:
    return datetime.now(UTC)


def _internal(name: object) -> bool:
    return isinstance(name, str) and name[: len(INTERNAL_PREFIX)].lower() == INTERNAL_PREFIX


class EnvelopeBuilder:
    """Builds checked envelopes for one endpoint's sends and publishes.

    ``hooks`` are the endpoint's ``@bus.outgoing`` hooks, which every outgoing
    message passes (:meth:`hooked`) before its envelope is built; ``now`` is the
    clock a ``delay`` counts from (a test's clock in :mod:`nmbus.testing`).
    """

    __slots__ = ("claim_check_bytes", "codec", "hooks", "max_message_bytes", "now", "routed")

    def __init__(
        self,
        max_message_bytes: int,
        now: Callable[[], datetime] = _utc_now,
        codec: Codec | None = None,
        claim_check_bytes: int | None = None,
    ) -> None:
        self.max_message_bytes = max_message_bytes
        #: A body over this many bytes is stored apart (the claim check); None: never.
        self.claim_check_bytes = claim_check_bytes
        #: Queues in other databases (routes): a body stored apart cannot go there.
        self.routed: frozenset[str] = frozenset()
        #: How bodies are encoded (nmbus.contracts): the endpoint's, shared with its registry.
        self.codec = codec if codec is not None else Codec()
        self.hooks: tuple[Link, ...] = ()
        self.now = now

    def add_hook(self, func: Any) -> Link:
        """Add ``async def h(msg, headers, call_next)`` around every outgoing message."""
        link = checked(func, "outgoing hook", "headers")
        self.hooks = (*self.hooks, link)
        return link

    async def hooked(self, message: Message, options: Outgoing) -> Outgoing:
        """``options`` as the outgoing hooks leave them (call it only when there are hooks).

        Each hook gets the message and its headers as a mutable dict of str to
        str, nmbus's own (``nmbus-*``) left out and put back after the hooks:
        they steer delivery and no hook may change them. Refused with
        InvalidMessage: a hook that raises it, one that returns without calling
        ``call_next`` (the message is not sent), or headers it left that are not
        str to str or name nmbus's own.
        """
        given = options.headers or {}
        own = {k: v for k, v in given.items() if _internal(k)}
        headers = {k: v for k, v in given.items() if not _internal(k)}
        stopped = await run_chain(self.hooks, message, headers, None, "outgoing hook")
        if stopped is not None:
            raise InvalidMessage(
                f"outgoing hook {name_of(stopped)} did not call call_next(): "
                f"{type_name(message)} is not sent"
            )
        for key, value in headers.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise InvalidMessage(
                    f"outgoing hooks must leave headers of str to str, got "
                    f"{type(key).__name__}: {type(value).__name__}"
                )
            if _internal(key):
                raise InvalidMessage(
                    f"header {key[:60]!r}: an outgoing hook may not set nmbus's own headers "
                    f"({INTERNAL_PREFIX}*)"
                )
        merged = {**headers, **own}
        return options.with_headers(merged or None)

    def for_send(self, message: Message, to: str, options: Outgoing) -> Envelope:
        """The envelope of a message sent to queue ``to`` (by the bus or a handler)."""
        validate_queue_name(to)
        envelope = self.build(message, options)
        if envelope.apart and to in self.routed:
            raise MessageTooLarge(
                f"{message.__type_name__} has a body over claim_check_bytes "
                f"({self.claim_check_bytes}), which cannot be stored apart for {to!r}: that "
                "queue is routed to another database, and the outbox carries whole rows"
            )
        return envelope

    def for_publish(self, message: Message, options: Outgoing) -> tuple[Envelope, str]:
        """The envelope of a published message and its type chain (comma-separated)."""
        if not isinstance(message, Message):
            raise TypeError(f"expected a nmbus.Message, got {type(message).__name__}")
        chain = chain_header(type(message))
        if chain is not None:
            options = options.marked({TYPE_CHAIN_HEADER: chain})
        envelope = self.build(message, options)
        if envelope.apart:
            raise MessageTooLarge(
                f"{message.__type_name__} has a body of {utf8_size(envelope.msg_text)} bytes, "
                f"over claim_check_bytes ({self.claim_check_bytes}): a body stored apart "
                "can be sent, not published; send it to each queue, or publish a smaller "
                "message that names where the data is"
            )
        return envelope, chain or envelope.label

    def build(self, message: Message, options: Outgoing) -> Envelope:
        if not isinstance(message, Message):
            raise TypeError(f"expected a nmbus.Message, got {type(message).__name__}")
        text, own = self.codec.encode(message)
        if own is not None:
            options = options.marked(own)
        headers, unique_id = options.headers, options.unique_id
        correlation_id, controls = options.correlation_id, options.controls
        header_text = None
        if headers:
            if not isinstance(headers, Mapping):
                raise InvalidMessage(
                    f"headers must be a mapping of str to str, got {type(headers).__name__}"
                )
            for key, value in headers.items():
                if not isinstance(key, str) or not isinstance(value, str):
                    raise InvalidMessage(
                        f"headers must map str to str, got {type(key).__name__}: "
                        f"{type(value).__name__}"
                    )
                # Refused here, not when the batch commits: a handler's bad header
                # must fail that handler, never its batch-mates.
                check_text(f"header {key[:60]!r}", key)
                check_text(f"header {key[:60]!r}", value)
            header_text = json.dumps(dict(headers), ensure_ascii=False)
        # The headers count: they are stored, and copied on every hop, like the body.
        limit = self.max_message_bytes
        chars = len(text) + (len(header_text) if header_text else 0)
        apart = False
        if (over := self.claim_check_bytes) is not None and len(text) * 4 > over:
            apart = self._apart(message, text)
            if apart:
                chars = len(header_text) if header_text else 0
        if chars * 4 > limit:
            body = 0 if apart else utf8_size(text)
            size = body + (utf8_size(header_text) if header_text else 0)
            if size > limit:
                raise MessageTooLarge(
                    f"{message.__type_name__} is {size} bytes serialized (body "
                    f"{body}, headers {size - body}), over the limit "
                    f"of {limit} (NMBUS_MAX_MESSAGE_BYTES)"
                )
        if unique_id is not None:
            check_key("unique_id", unique_id)
        if correlation_id is not None and (not isinstance(correlation_id, str) or correlation_id):
            check_key("correlation_id", correlation_id)
        uid = unique_id or uuid.uuid4().hex
        delay = options.delay
        return Envelope(
            label=message.__type_name__,
            msg_text=text,
            msg_headers=header_text,
            unique_id=uid,
            correlation_id=correlation_id or uid,
            deliver_at=(
                options.deliver_at if delay is None else self.now() + timedelta(seconds=delay)
            ),
            priority=controls.priority,
            sequence=controls.sequence,
            expires_at=controls.expires_at,
            apart=apart,
        )

    def _apart(self, message: Message, text: str) -> bool:
        """Whether the body ``text`` goes apart (over claim_check_bytes); refused when it
        is over what the claim check takes."""
        body = utf8_size(text)
        if self.claim_check_bytes is None or body <= self.claim_check_bytes:
            return False
        if body > MAX_CLAIM_CHECK_BYTES:
            raise MessageTooLarge(
                f"{message.__type_name__} has a body of {body} bytes, over the "
                f"{MAX_CLAIM_CHECK_BYTES} bytes the claim check stores apart"
            )
        return True
