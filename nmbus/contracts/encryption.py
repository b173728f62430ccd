"""Encrypted fields: ``card_number: Encrypted[str]`` is stored sealed, read in the clear.

A field marked :data:`Encrypted` is sealed by :meth:`Codec.encode
<nmbus.contracts.Codec.encode>` with AES-GCM (the ``cryptography`` package)
under the endpoint's current key, and opened by :meth:`Codec.decode
<nmbus.contracts.Codec.decode>` before validation. In the stored JSON body the
field's value becomes ``{"nmbus-encrypted": "<key id>", "data": "<base64>"}``,
``data`` being a 12-byte random nonce followed by the ciphertext and its tag.
The associated data binds it to the message's type name and the field's name,
so a sealed value copied into another field or type does not open.

Every copy of a body (queue row, outbox, forwarder, F copy, archive) is the
stored text, so every copy holds only ciphertext. Fields of the message itself
are sealed; a nested model that marks a field is refused at send.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from functools import lru_cache
from typing import TYPE_CHECKING, Annotated, Any, get_args

from pydantic import BaseModel, ValidationError

from nmbus.errors import InvalidMessage, UndecodableMessage, UnknownEncryptionKey

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from nmbus.messages import Message
    from nmbus.settings import EncryptionKeys

#: The key of the object that stands for a sealed value in a stored body.
SEALED = "nmbus-encrypted"
_NONCE = 12


class _Marker:
    """What ``Encrypted[T]`` adds to ``T``'s metadata: seal this field."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "Encrypted"


_MARK = _Marker()


class Encrypted:
    """``Encrypted[T]``: a field of type ``T`` stored encrypted (docs/messages.md).

    The handler reads a plain ``T``; the queue table, the outbox and every
    copy of the message hold only its ciphertext.
    """

    __slots__ = ()

    def __class_getitem__(cls, item: Any) -> Any:
        return Annotated[item, _MARK]


def _marked(field: Any) -> bool:
    return any(m is _MARK for m in field.metadata)


def _nested_mark(annotation: Any, seen: set[type]) -> str | None:
    """The dotted name of an Encrypted field inside a nested model of ``annotation``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if annotation in seen:
            return None
        seen.add(annotation)
        for name, field in annotation.model_fields.items():
            if _marked(field):
                return f"{annotation.__name__}.{name}"
            found = _nested_mark(field.annotation, seen)
            if found:
                return found
        return None
    for arg in get_args(annotation):
        found = _nested_mark(arg, seen)
        if found:
            return found
    return None


class Sealer:
    """The Encrypted fields of one message class, and how to seal and open them."""

    __slots__ = ("fields", "nested", "type_name")

    def __init__(self, cls: type[Message]) -> None:
        self.type_name = cls.__type_name__
        self.fields = tuple(name for name, f in cls.model_fields.items() if _marked(f))
        seen: set[type] = {cls}
        self.nested = next(
            (
                found
                for name, f in cls.model_fields.items()
                if not _marked(f) and (found := _nested_mark(f.annotation, seen))
            ),
            None,
        )

    def _aad(self, field: str) -> bytes:
        return f"nmbus-encrypted\x00{self.type_name}\x00{field}".encode()

    def seal(self, text: str, keys: EncryptionKeys | None) -> str:
        """``text`` (a JSON body) with each Encrypted field sealed under the current key."""
        if self.nested is not None:
            raise InvalidMessage(
                f"{self.type_name}: {self.nested} is Encrypted inside a nested model; "
                "only the message's own fields can be encrypted"
            )
        if keys is None:
            raise InvalidMessage(
                f"{self.type_name} has encrypted fields ({', '.join(self.fields)}) but this "
                "bus has no encryption key: pass Bus(..., encryption_keys=..., "
                "encryption_key_id=...) or set NMBUS_ENCRYPTION_KEYS"
            )
        key_id = keys.current
        cipher = _cipher(keys.key(key_id))
        body = json.loads(text)
        for field in self.fields:
            if field not in body:
                continue
            plain = json.dumps(body[field], separators=(",", ":")).encode()
            nonce = os.urandom(_NONCE)
            sealed = nonce + cipher.encrypt(nonce, plain, self._aad(field))
            body[field] = {SEALED: key_id, "data": base64.b64encode(sealed).decode("ascii")}
        return json.dumps(body, separators=(",", ":"))

    def open(self, text: str, keys: EncryptionKeys | None) -> str:
        """``text`` (a stored body) with each sealed field opened.

        Raises UnknownEncryptionKey for a key id this endpoint does not hold and
        UndecodableMessage for a value that does not authenticate. A field
        stored in the clear (sent before it was marked Encrypted) is left as is.
        """
        body = json.loads(text)
        if not isinstance(body, dict):
            return text  # validation says what is wrong with it
        changed = False
        for field in self.fields:
            value = body.get(field)
            if not (isinstance(value, dict) and SEALED in value):
                continue
            key_id = value.get(SEALED)
            if not isinstance(key_id, str) or keys is None or key_id not in keys:
                raise UnknownEncryptionKey(
                    f"{self.type_name}.{field} is encrypted with key id {_id(key_id)}, which "
                    "this endpoint does not hold: add that key to encryption_keys "
                    "(NMBUS_ENCRYPTION_KEYS)"
                )
            body[field] = self._open_one(field, key_id, value.get("data"), keys)
            changed = True
        return json.dumps(body, separators=(",", ":")) if changed else text

    def _open_one(self, field: str, key_id: str, data: Any, keys: EncryptionKeys) -> Any:
        from cryptography.exceptions import InvalidTag

        try:
            if not isinstance(data, str):
                raise ValueError
            sealed = base64.b64decode(data, validate=True)
            if len(sealed) <= _NONCE:
                raise ValueError
            plain = _cipher(keys.key(key_id)).decrypt(
                sealed[:_NONCE], sealed[_NONCE:], self._aad(field)
            )
            return json.loads(plain)
        except (InvalidTag, ValueError, binascii.Error):
            raise UndecodableMessage(
                f"{self.type_name}.{field}: its encrypted value (key id {key_id!r}) does not "
                "authenticate: altered, or sealed for another type or field"
            ) from None


@lru_cache(maxsize=32)
def _cipher(key: bytes) -> AESGCM:
    # Built once per key: a new AESGCM sets up its key schedule each time.
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(key)


def _id(key_id: Any) -> str:
    if isinstance(key_id, str) and len(key_id) <= 64 and key_id.isprintable():
        return repr(key_id)
    return "(not a key id)"


def sealer(cls: type[Message], cache: dict[type[Message], Sealer | None]) -> Sealer | None:
    """The Sealer of ``cls``, None when it has no Encrypted field (kept in ``cache``)."""
    try:
        return cache[cls]
    except KeyError:
        found = Sealer(cls)
        result = found if found.fields or found.nested else None
        cache[cls] = result
        return result


def readable(text: str | None) -> str | None:
    """A stored body for an operator's eyes: each encrypted value as ``[encrypted, key k2]``.

    Any other text (not JSON, cut short, no encrypted field) is returned as it is.
    """
    if text is None or SEALED not in text:
        return text
    try:
        body = json.loads(text)
    except ValueError:
        return text
    if not isinstance(body, dict):
        return text
    for field, value in body.items():
        if isinstance(value, dict) and set(value) == {SEALED, "data"}:
            body[field] = f"[encrypted, key {value[SEALED]}]"
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def without_values(exc: ValidationError) -> str:
    """What ``exc`` refused, by field and reason, never repeating a value."""
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or 'body'}: {error['msg']}"
        for error in exc.errors(include_input=False, include_context=False)
    )
