"""Message contracts over time: a body on its way out of the process and back in.

Every message body passes one :class:`Codec` when it is encoded for sending
(:meth:`Codec.encode`, called by the envelope builder) and when a stored body is
decoded for a handler (:meth:`Codec.decode`, called by the dispatcher, the saga
locks, the replies and :mod:`nmbus.testing`). It is the one place where a body
is changed on the way: versions and their upcasters, encrypted fields. A type
that uses none of them is encoded and validated exactly as before, with no
work beyond one check.

A stored body the codec cannot read for a reason no retry can change (a
version this process does not know, a key id it does not hold) raises a
:class:`~nmbus.errors.MessageError`, which fails the message at once (F).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from pydantic import ValidationError

from nmbus.contracts.encryption import Sealer, sealer, without_values
from nmbus.contracts.versions import VERSION_HEADER, Versions, stored_version
from nmbus.errors import UndecodableMessage
from nmbus.messages import Message, encode

if TYPE_CHECKING:
    from nmbus.settings import EncryptionKeys


class Codec:
    """Encodes outgoing bodies and decodes stored ones, for one endpoint."""

    __slots__ = ("_sealers", "keys", "versions")

    def __init__(self) -> None:
        #: The keys of encrypted fields (nmbus.contracts.encryption); None: none.
        self.keys: EncryptionKeys | None = None
        self._sealers: dict[type[Message], Sealer | None] = {}
        #: The upcasters registered with ``@bus.upcaster`` (nmbus.contracts.versions).
        self.versions = Versions()

    def encode(self, message: Message) -> tuple[str, dict[str, str] | None]:
        """The JSON body of ``message`` and the headers nmbus adds for it (None for none).

        Raises InvalidMessage when no receiver could read it (nmbus.messages.encode).
        """
        text = encode(message)
        if (seal := sealer(type(message), self._sealers)) is not None:
            text = seal.seal(text, self.keys)
        version = message.__version__
        return text, ({VERSION_HEADER: str(version)} if version != 1 else None)

    def seals(self, cls: type[Message]) -> bool:
        """Whether ``cls`` has encrypted fields, which the codec seals and opens."""
        return sealer(cls, self._sealers) is not None

    def decode(self, cls: type[Message], text: str, headers: str | None) -> Message:
        """The message of a stored body ``text`` (with its raw JSON ``headers``) as ``cls``.

        Raises pydantic's ValidationError or ValueError for a body that does not
        validate (UndecodableMessage at the caller), and a MessageError for one
        that must fail at once for another reason. A type with encrypted fields
        raises UndecodableMessage itself, naming fields and reasons but no value.
        An older body is upcast to ``cls``'s version first (nmbus.contracts.versions).
        """
        version = stored_version(headers)
        if (seal := sealer(cls, self._sealers)) is None:
            if version != cls.__version__:
                text = self._upcast(cls, text, version, secret=False)
            return cls.__pydantic_validator__.validate_json(text)  # type: ignore[no-any-return]
        # Opened first: upcasters see the body's fields in the clear.
        text = seal.open(text, self.keys)
        if version != cls.__version__:
            text = self._upcast(cls, text, version, secret=True)
        try:
            return cls.__pydantic_validator__.validate_json(text)  # type: ignore[no-any-return]
        except ValidationError as exc:
            reason = without_values(exc)
        # Raised outside the except: pydantic's error repeats the value it refused
        # (here, maybe a decrypted one), so it must not travel as the context.
        raise UndecodableMessage(f"body is not a valid {cls.__type_name__}: {reason}")

    def _upcast(self, cls: type[Message], text: str, version: int, *, secret: bool) -> str:
        """``text`` of ``version`` upcast to ``cls``'s version, as JSON to validate exactly
        as a sent body. ``secret``: the body holds opened encrypted fields, which an
        upcaster's error must not carry into error_info."""
        body = self.versions.upcast(cls, text, version, secret=secret)
        return body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)
