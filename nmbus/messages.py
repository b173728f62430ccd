"""Messages: pydantic models with a stable type name, and their envelopes.

A message's *type name* is what the ``label`` column holds and what
subscriptions match on. It defaults to the class name and is set explicitly
with a class keyword, so two code bases can agree on it without sharing
Python modules::

    class OrderPlaced(Message, type_name="orders.OrderPlaced"):
        order_id: int
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticSerializationError

from nmbus.errors import ConfigurationError, InvalidMessage

# Key and text rules live in nmbus.names; importable from here as before.
from nmbus.names import MAX_KEY_BYTES as MAX_KEY_BYTES
from nmbus.names import check_key as check_key
from nmbus.names import check_text as check_text
from nmbus.names import utf8_size as utf8_size

_TYPE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:\-]{0,199}$")

# The highest message version accepted (a header value must stay short and an int4).
MAX_VERSION = 1_000_000

# Every concrete type name known in this process, for decoding labels.
_TYPES: dict[str, type[Message]] = {}


class Message(BaseModel):
    """Base class of every message. Subclass it like any pydantic model."""

    # Frozen: a handler cannot change a message others also receive. Unknown
    # fields are ignored so a newer sender can add fields without breaking us.
    # Non-finite floats serialize as NaN/Infinity rather than a silent null, so
    # that encode() can see them and refuse the message at send.
    model_config = ConfigDict(frozen=True, ser_json_inf_nan="constants")

    __type_name__: ClassVar[str] = "Message"
    #: The version of this type's body (``version=`` class keyword; 1 by default).
    __version__: ClassVar[int] = 1

    def __init_subclass__(
        cls, type_name: str | None = None, version: int = 1, **kwargs: Any
    ) -> None:
        super().__init_subclass__(**kwargs)
        name = type_name if type_name is not None else cls.__qualname__
        if not _TYPE_NAME.fullmatch(name):
            raise ConfigurationError(
                f"invalid message type name {name!r}: use letters, digits, '_', '.', ':' "
                "or '-', starting with a letter, at most 200 characters"
            )
        if (
            isinstance(version, bool)
            or not isinstance(version, int)
            or not 1 <= version <= MAX_VERSION
        ):
            raise ConfigurationError(
                f"invalid version {version!r} for message type {name!r}: "
                f"use a whole number from 1 to {MAX_VERSION}"
            )
        cls.__type_name__ = name
        cls.__version__ = version

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        # Register only once pydantic has built the class; a name clash with a
        # different class is a bug the user must see now, not at the first message.
        name = cls.__type_name__
        known = _TYPES.get(name)
        if known is not None and known is not cls and _qualified(known) != _qualified(cls):
            raise ConfigurationError(
                f"message type name {name!r} is used by both {_qualified(known)} and "
                f"{_qualified(cls)}; give one of them type_name=..."
            )
        _TYPES[name] = cls


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def type_name(cls: type[Message]) -> str:
    """The stable type name of a Message class."""
    return cls.__type_name__


def message_version(cls: type[Message]) -> int:
    """The version of a Message class's body (1 unless it was given ``version=``)."""
    return cls.__version__


def type_chain(cls: type[Message]) -> tuple[str, ...]:
    """Type names of ``cls`` and of its Message ancestors, most specific first."""
    return tuple(
        base.__type_name__
        for base in cls.__mro__
        if isinstance(base, type) and issubclass(base, Message) and base is not Message
    )


def subtypes(cls: type[Message]) -> list[type[Message]]:
    """``cls`` and every Message class registered in this process that derives from it."""
    return [cls, *(t for t in _TYPES.values() if t is not cls and issubclass(t, cls))]


def lookup_type(name: str) -> type[Message] | None:
    """The Message class registered under ``name`` in this process, if any."""
    return _TYPES.get(name)


def encode(message: Message) -> str:
    """The JSON body of ``message``; :class:`InvalidMessage` if its receiver could not read it.

    JSON has no infinity or NaN: a message holding one is refused here rather
    than stored as a body that fails to decode at the receiver. A null that the
    class itself cannot read back (a float inside a nested plain pydantic model
    that was inf or nan) is refused as well.
    """
    name = message.__type_name__
    try:
        text = message.model_dump_json()
    except PydanticSerializationError as exc:
        raise InvalidMessage(f"{name} cannot be serialized to JSON: {_line(exc)}") from exc
    if ("NaN" in text or "Infinity" in text) and (found := _non_finite(text)) is not None:
        where, constant = found
        raise InvalidMessage(
            f"{name}.{where} is {constant}: JSON has no infinity or NaN, so no receiver could "
            "read it; send a finite number, None or a string instead"
        )
    if "null" in text:
        try:
            type(message).model_validate_json(text)
        except ValidationError as exc:
            nulls = [e for e in exc.errors() if e["input"] is None]
            if nulls:
                where = ".".join(str(part) for part in nulls[0]["loc"])
                raise InvalidMessage(
                    f"{name}.{where} is sent as null, which {name} cannot read back "
                    f"({nulls[0]['msg']}); an inf or nan float in a nested model becomes null: "
                    "send a finite number"
                ) from None
    return text


class _Constant(str):
    """A NaN or Infinity token found by json.loads."""


def _non_finite(text: str) -> tuple[str, str] | None:
    """Where the first NaN/Infinity token of JSON ``text`` is, as a dotted path."""

    def walk(value: Any, path: str) -> tuple[str, str] | None:
        if isinstance(value, _Constant):
            return path, str(value)
        items: Any = ()
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        for key, item in items:
            found = walk(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
        return None

    return walk(json.loads(text, parse_constant=_Constant), "")


def _line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


@dataclass(slots=True)
class Envelope:
    """A serialized message on its way into a queue table."""

    label: str
    msg_text: str
    msg_headers: str | None
    unique_id: str
    correlation_id: str | None
    deliver_at: datetime | None
    # Delivery controls (docs/delivery.md): higher priority is claimed first; members
    # of one sequence are handled one at a time in send order; past expires_at the
    # message is never handed to a handler.
    priority: int = 0
    sequence: str | None = None
    expires_at: datetime | None = None
    # The claim check (docs/messages.md): its body is over claim_check_bytes and is
    # stored apart by the store that writes it; the row keeps a reference.
    apart: bool = False


@dataclass(slots=True)
class StoredMessage:
    """A row claimed from a queue table for handling."""

    id: int
    from_endpoint: str
    insert_time: datetime
    retry_count: int
    retry_time: datetime
    correlation_id: str | None
    label: str | None
    msg_text: str | None
    msg_headers: str | None
    unique_id: str
    # How the row came back (Recovery): 0 fresh; non-zero after a crash.
    recovered: int = 0
    priority: int = 0
    # Its expires_at had passed when it was claimed: no handler may see it.
    expired: bool = False
    # The claim it is leased under (its token): every finish, renewal and give-back
    # of the row names it, so one claim never changes a row another claim took.
    claim: str = ""
