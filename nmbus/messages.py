"""Messages: pydantic models with a stable type name, and their envelopes.

A message's *type name* is what the ``label`` column holds and what
subscriptions match on. It defaults to the class name and is set explicitly
with a class keyword, so two code bases can agree on it without sharing
Python modules::

    class OrderPlaced(Message, type_name="orders.OrderPlaced"):
        order_id: int
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from nmbus.errors import ConfigurationError

_TYPE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:\-]{0,199}$")

# Every concrete type name known in this process, for decoding labels.
_TYPES: dict[str, type[Message]] = {}


class Message(BaseModel):
    """Base class of every message. Subclass it like any pydantic model."""

    # Frozen: a handler cannot change a message others also receive. Unknown
    # fields are ignored so a newer sender can add fields without breaking us.
    model_config = ConfigDict(frozen=True)

    __type_name__: ClassVar[str] = "Message"

    def __init_subclass__(cls, type_name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = type_name if type_name is not None else cls.__qualname__
        if not _TYPE_NAME.fullmatch(name):
            raise ConfigurationError(
                f"invalid message type name {name!r}: use letters, digits, '_', '.', ':' "
                "or '-', starting with a letter, at most 200 characters"
            )
        cls.__type_name__ = name

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


def type_chain(cls: type[Message]) -> tuple[str, ...]:
    """Type names of ``cls`` and of its Message ancestors, most specific first."""
    return tuple(
        base.__type_name__
        for base in cls.__mro__
        if isinstance(base, type) and issubclass(base, Message) and base is not Message
    )


def lookup_type(name: str) -> type[Message] | None:
    """The Message class registered under ``name`` in this process, if any."""
    return _TYPES.get(name)


@dataclass(slots=True)
class Envelope:
    """A serialized message on its way into a queue table."""

    label: str
    msg_text: str
    msg_headers: str | None
    unique_id: str
    correlation_id: str | None
    deliver_at: datetime | None


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
    recovered: bool = False
