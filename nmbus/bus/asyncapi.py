"""The contract document of an endpoint: AsyncAPI 3.0, from what its Bus declares.

Pure: it reads the Bus's registration (handlers, subscriptions, the types it
declares it publishes and sends) and the messages' pydantic models; it never
starts the Bus nor reaches a database. ``nmbus asyncapi MODULE:BUS`` prints it.

How nmbus maps onto AsyncAPI (docs/cli.md, "nmbus asyncapi"):

* ``queue.<name>``: the channel of a queue (its address is the queue's name,
  its table ``<schema>.<name>``): this endpoint's own, and each queue it
  declares it sends to (``bus.sends(T, to=...)``).
* ``published.<endpoint>``: the channel of what an endpoint publishes. It has
  no address: each subscriber's copy goes into that subscriber's own queue.
* Operations: ``receive.<type>`` on the endpoint's queue for each handled type,
  ``subscribe.<publisher>.<type>`` on the publisher's channel for each
  subscription it holds, ``publish.<type>`` and ``send.<queue>.<type>`` for
  each declared outgoing type.
* Messages: by type name, with the type's version, its payload as the pydantic
  JSON schema, and the headers nmbus sets.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

from pydantic.json_schema import models_json_schema

from nmbus import envelopes
from nmbus.contracts.versions import VERSION_HEADER
from nmbus.delivery.flow import GROUP_HEADER
from nmbus.errors import ConfigurationError
from nmbus.messages import Message, type_name
from nmbus.messages import message_version as _class_version

if TYPE_CHECKING:
    from nmbus.bus.bus import Bus

#: The AsyncAPI version of the document.
ASYNCAPI_VERSION = "3.0.0"
#: Where the payload schemas are; the name of the headers' schema (no model's name
#: has a ``-``, so it never meets one of theirs).
SCHEMAS = "#/components/schemas/"
HEADERS_SCHEMA = "nmbus-headers"

# What a key of a components map may hold (AsyncAPI: ^[\w\d\.\-_]+$).
_KEY = re.compile(r"[^A-Za-z0-9._-]")


def message_version(cls: type[Message]) -> int:
    """The version of a message type, as the document states it (its ``version=``)."""
    return _class_version(cls)


#: The headers nmbus sets (nmbus/envelopes.py), and what each one says.
NMBUS_HEADERS: dict[str, str] = {
    envelopes.TYPE_CHAIN_HEADER: (
        "On a published message whose class has Message ancestors: the type names of its "
        "class and of those ancestors, most specific first, comma-separated. A subscriber "
        "that knows only an ancestor decodes the message as that ancestor."
    ),
    envelopes.SAGA_HEADER: "On a saga's timeout: the name of the saga that set it.",
    envelopes.SAGA_KEY_HEADER: "On a saga's timeout: the key of the saga that set it.",
    envelopes.SAGA_INSTANCE_HEADER: (
        "On a saga's timeout: the saga instance that set it (a timeout acts on that instance only)."
    ),
    VERSION_HEADER: (
        "On a message whose class has version= other than 1: that version. Absent means 1; "
        "a receiver upcasts an older body to its own version (docs/messages.md)."
    ),
    envelopes.UNIQUE_WHILE_HEADER: (
        "On a message sent with unique_while='pending': its unique_id holds only while it "
        "waits in I or R (docs/messages.md)."
    ),
    envelopes.UNIQUE_FOR_HEADER: (
        "On a message sent with unique_for=: for how many seconds after the first send its "
        "unique_id holds (docs/messages.md)."
    ),
    GROUP_HEADER: (
        "On a message sent with group=: its group, within which its handler's "
        "group_concurrency holds (docs/flow-control.md)."
    ),
    envelopes.REPLY_TO_HEADER: "On a request: the endpoint its reply goes to.",
    envelopes.IN_REPLY_TO_HEADER: "On a reply: the unique id of the message it answers.",
    envelopes.REQUESTER_HEADER: (
        "On a request, copied onto its reply: the client id of the process waiting for it."
    ),
    envelopes.REPLY_BY_HEADER: (
        "On a request, copied onto its reply: until when (ISO 8601) its requester waits."
    ),
    envelopes.CLAIM_CHECK_HEADER: (
        "On a message whose body is stored apart (the claim check): its payload's key; "
        "its body is put back before any handler sees it."
    ),
    envelopes.CLAIM_CHECK_BYTES_HEADER: (
        "On a message whose body is stored apart: the size of that body, in bytes."
    ),
    envelopes.FAILED_QUEUE_HEADER: (
        "On a failure port's copy: the queue whose message landed in F (it stays there)."
    ),
    envelopes.FAILED_ID_HEADER: "On a failure port's copy: the row id of the original, in F.",
    envelopes.FAILED_UNIQUE_ID_HEADER: "On a failure port's copy: the original's unique id.",
    envelopes.FAILED_ERROR_HEADER: (
        "On a failure port's copy: the first line of the error it failed with."
    ),
    # nmbus.telemetry.tracing's TRACEPARENT and TRACESTATE (a module that needs the otel
    # extra to be imported; tests/test_asyncapi.py compares the names).
    "traceparent": (
        "With tracing on (nmbus[otel]): the W3C trace context of the span that sent it; "
        "handling it is a span of that trace. It travels onto what a handler sends."
    ),
    "tracestate": "With tracing on: the W3C trace state that goes with traceparent.",
}


def document(bus: Bus, version: str = "1.0.0") -> dict[str, Any]:
    """The AsyncAPI 3.0 document of ``bus``'s endpoint; ``version``: the application's.

    Raises :class:`~nmbus.errors.ConfigurationError` when a message type has no
    JSON schema (a field pydantic cannot describe), naming the type.
    """
    return _Contract(bus, version).build()


class _Contract:
    """One document in the making: its channels, operations and messages."""

    def __init__(self, bus: Bus, version: str) -> None:
        self.bus = bus
        self.version = version
        self.endpoint = bus.endpoint
        self.schema = bus.settings.schema_name
        self.channels: dict[str, dict[str, Any]] = {}
        self.operations: dict[str, dict[str, Any]] = {}
        # Message keys by type name, and the classes in the order first met.
        self.keys: dict[str, str] = {}
        self.types: dict[str, type[Message]] = {}

    def build(self) -> dict[str, Any]:
        bus = self.bus
        own = self.queue(self.endpoint)
        handled: dict[str, type[Message]] = {}
        for handler in bus.registry:
            handled.setdefault(type_name(handler.message_type), handler.message_type)
        for name, cls in handled.items():
            self.operate(
                f"receive.{self.key(cls)}",
                "receive",
                own,
                cls,
                f"Handle {name}" + ("" if cls is Message else " and its subclasses"),
                f"Each {name} in queue {self.endpoint} runs this endpoint's handlers of it "
                "in the message's transaction; a failure retries it and, in the end, leaves "
                "it in F.",
            )
        for sub in sorted(bus.subscriptions.declared, key=lambda s: (s.publisher, s.type_name)):
            lifetime = (
                "permanent: it never expires"
                if sub.permanent or bus.settings.subscription_ttl is None
                else f"renewed while this endpoint runs, it expires "
                f"{bus.settings.subscription_ttl:g} s after the last renewal"
            )
            self.operate(
                f"subscribe.{_KEY.sub('_', sub.publisher)}.{self.key(sub.message_type)}",
                "receive",
                self.publications(sub.publisher),
                sub.message_type,
                f"Subscribe to {sub.type_name} published by {sub.publisher}",
                f"A row of {self.schema}.subscriptions ({lifetime}): each {sub.type_name} "
                f"that {sub.publisher} publishes, and each of its subclasses, is copied into "
                f"queue {self.endpoint}.",
            )
        outgoing = bus.outgoing_types
        for name, cls in sorted(outgoing.published.items()):
            self.operate(
                f"publish.{self.key(cls)}",
                "send",
                self.publications(self.endpoint),
                cls,
                f"Publish {name}",
                f"Each subscriber to {name} (or to an ancestor of it) from {self.endpoint} "
                "gets a copy in its own queue, in the publisher's transaction.",
            )
        for (queue, name), cls in sorted(outgoing.sent.items()):
            self.operate(
                f"send.{_KEY.sub('_', queue)}.{self.key(cls)}",
                "send",
                self.queue(queue),
                cls,
                f"Send {name} to {queue}",
                f"Stored in queue {queue}, in the sender's transaction.",
            )
        return {
            "asyncapi": ASYNCAPI_VERSION,
            "info": {
                "title": self.endpoint,
                "version": self.version,
                "description": self.description(),
            },
            "defaultContentType": "application/json",
            "channels": self.channels,
            "operations": self.operations,
            "components": self.components(),
        }

    def description(self) -> str:
        text = (
            f"The nmbus endpoint {self.endpoint}: what it handles, the subscriptions it "
            "holds, and the types it declares it publishes and sends."
        )
        if self.bus.dead_letter is not None:
            text += (
                f" A copy of each message that lands in F goes to queue "
                f"{self.bus.dead_letter}, its failure port."
            )
        return text

    def queue(self, name: str) -> str:
        channel = f"queue.{name}"
        if channel not in self.channels:
            self.channels[channel] = {
                "address": name,
                "title": f"queue {name}",
                "description": (
                    f"The queue table {self.schema}.{name}: a message is a row, ready (I), "
                    "scheduled or retrying (R), processed (X) or failed (F). The row's label "
                    "column holds the message's type name, msg_text its JSON body, "
                    "msg_headers its headers."
                ),
                "messages": {},
            }
        return channel

    def publications(self, publisher: str) -> str:
        channel = f"published.{publisher}"
        if channel not in self.channels:
            self.channels[channel] = {
                "address": None,
                "title": f"published by {publisher}",
                "description": (
                    f"What endpoint {publisher} publishes. A publish stores a copy in the "
                    f"queue of each endpoint subscribed to the message's type (or an "
                    f"ancestor of it) from {publisher}, in one statement with the "
                    "publisher's transaction: there is no single address."
                ),
                "messages": {},
            }
        return channel

    def operate(
        self, key: str, action: str, channel: str, cls: type[Message], summary: str, text: str
    ) -> None:
        message = self.key(cls)
        self.channels[channel]["messages"][message] = {"$ref": f"#/components/messages/{message}"}
        # Dots join names that may hold dots: publisher "a.b" of type "c" and publisher
        # "a" of type "b.c" make the same key; the second gets a number.
        key = _unused(key, self.operations)
        self.operations[key] = {
            "action": action,
            "channel": {"$ref": f"#/channels/{channel}"},
            "summary": summary,
            "description": text,
            "messages": [{"$ref": f"#/channels/{channel}/messages/{message}"}],
        }

    def key(self, cls: type[Message]) -> str:
        """The components key of ``cls``: its type name, with what a key cannot hold as ``_``."""
        name = type_name(cls)
        found = self.keys.get(name)
        if found is None:
            found = self.keys[name] = _unused(_KEY.sub("_", name), set(self.keys.values()))
            self.types[name] = cls
        return found

    def components(self) -> dict[str, Any]:
        refs, schemas = _json_schemas(self.types.items())
        return {"messages": self.messages(refs), "schemas": self.schemas(schemas)}

    def messages(self, refs: dict[str, Any]) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for name, cls in self.types.items():
            message: dict[str, Any] = {
                "name": name,
                "title": cls.__name__,
                "contentType": "application/json",
                "headers": {"$ref": SCHEMAS + HEADERS_SCHEMA},
                "payload": refs[name],
                "x-nmbus-type-name": name,
                "x-nmbus-version": message_version(cls),
            }
            doc = (cls.__doc__ or "").strip()
            if doc and cls.__doc__ != Message.__doc__:
                message["summary"] = doc.splitlines()[0]
            found[self.keys[name]] = message
        return dict(sorted(found.items()))

    def schemas(self, found: dict[str, Any]) -> dict[str, Any]:
        schemas = dict(sorted(found.items()))
        schemas[HEADERS_SCHEMA] = {
            "type": "object",
            "description": (
                "A message's headers: a JSON object of strings, in the msg_headers column. "
                "The application's own headers travel onto what a handler sends while it "
                "handles the message; nmbus's own (nmbus-*) describe one message only, and "
                "only nmbus sets them."
            ),
            "properties": {
                name: {"type": "string", "description": text}
                for name, text in NMBUS_HEADERS.items()
            },
            "additionalProperties": {"type": "string"},
        }
        return schemas


def _unused(key: str, taken: Collection[str]) -> str:
    """``key``, or ``key_2``, ``key_3`` ... : the first that is not taken."""
    found, n = key, 2
    while found in taken:
        found, n = f"{key}_{n}", n + 1
    return found


def _json_schemas(
    types: Iterable[tuple[str, type[Message]]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each type's payload (a reference) and the schemas they refer to, from pydantic."""
    pairs = list(types)
    try:
        refs, top = models_json_schema(
            [(cls, "validation") for _, cls in pairs], ref_template=SCHEMAS + "{model}"
        )
    except Exception as exc:
        raise ConfigurationError(_undescribable(pairs, exc)) from exc
    defs = {name: _dialect(schema) for name, schema in top.get("$defs", {}).items()}
    return {name: refs[(cls, "validation")] for name, cls in pairs}, defs


def _undescribable(pairs: list[tuple[str, type[Message]]], exc: Exception) -> str:
    """What to say when pydantic cannot make a JSON schema: the first type it fails on."""
    culprit = ", ".join(name for name, _ in pairs)
    for name, cls in pairs:
        try:
            cls.model_json_schema()
        except Exception:
            culprit = name
            break
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"cannot describe message type {culprit} as JSON schema: {first}"


def _dialect(schema: Any) -> Any:
    """A pydantic (JSON Schema 2020-12) schema in AsyncAPI's dialect (draft-07 and more).

    Three things differ: a tuple's ``prefixItems`` is draft-07's ``items`` list
    (the rest in ``additionalItems``); pydantic's OpenAPI-style discriminator
    object is left out (its ``oneOf`` of literal-tagged models already says
    which is which; AsyncAPI's ``discriminator`` is a property name for
    inheritance); and a value JSON cannot hold (an infinite default) is left out.
    """
    if not isinstance(schema, dict):
        return schema  # true or false
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _dialect(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_dialect(sub) for sub in value]
        elif key in _SCHEMAS:
            out[key] = _dialect(value)
        elif key == "discriminator" and isinstance(value, dict):
            continue
        elif _finite(value):
            out[key] = value
    if "prefixItems" in out:
        rest = out.pop("items", None)
        out["items"] = out.pop("prefixItems")
        if rest is not None:
            out["additionalItems"] = rest
    return out


# The keywords whose values are schemas: maps of them, lists of them, or one.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
_SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
_SCHEMAS = frozenset(
    {
        "items",
        "additionalItems",
        "additionalProperties",
        "not",
        "if",
        "then",
        "else",
        "contains",
        "propertyNames",
    }
)


def _finite(value: Any) -> bool:
    """Whether JSON can hold ``value``: no infinity or NaN anywhere in it."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True
