"""A claimed row, decoded once: the class its body is read as, and its headers.

The worker makes one :class:`Received` per row of a batch and hands it down:
to the saga locks, to the dispatcher (a reply's hand-back,
the handlers, the retry policy), to the handler's Context and to its span. The
type is looked up once and the headers JSON is parsed at most once, when
something first reads it; no one reads the raw columns again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import suppress
from typing import Any

from nmbus.envelopes import TYPE_CHAIN_HEADER, nearest_known
from nmbus.messages import Message, StoredMessage, lookup_type


class Received:
    """One claimed row with its message class and (parsed on first use) its headers."""

    __slots__ = ("_headers", "cls", "found", "message", "row", "sagas")

    def __init__(self, row: StoredMessage) -> None:
        self.row = row
        self._headers: dict[str, Any] | None = None
        #: The saga states its batch holds for it (nmbus.sagas.states.SagaStates), set by
        #: the saga locks before the handlers run; None when it needs none.
        self.sagas: Any = None
        #: The sagas it names (saga and key pairs), once the saga locks have found them.
        self.found: Any = None
        #: Its body, decoded before its handlers run (by the saga locks), for the
        #: first run of its handlers only: a run again decodes it anew.
        self.message: Message | None = None
        #: The class to decode the body as: the row's own type, else the nearest
        #: known ancestor its type-chain header names; None when none is known here.
        self.cls: type[Message] | None = lookup_type(row.label) if row.label else None
        if self.cls is None and self.mentions(TYPE_CHAIN_HEADER):
            with suppress(ValueError):
                self.cls = nearest_known(self.headers.get(TYPE_CHAIN_HEADER))

    def mentions(self, name: str) -> bool:
        """Whether the raw headers hold ``name`` at all: a header to look for, without parsing."""
        raw = self.row.msg_headers
        return raw is not None and name in raw

    @property
    def headers(self) -> Mapping[str, Any]:
        """The row's headers: ``{}`` for none, or for JSON that is not an object.

        Raises ValueError when they are not JSON at all (written by hand).
        """
        headers = self._headers
        if headers is None:
            raw = self.row.msg_headers
            parsed = json.loads(raw) if raw else {}
            headers = self._headers = parsed if isinstance(parsed, dict) else {}
        return headers

    def __repr__(self) -> str:
        return f"<Received {self.row.id} {self.row.label!r}>"
