"""Message versions and their upcasters.

A type's version travels in the ``nmbus-version`` header, set only when it is
not 1 (no header means version 1, so a queue that uses no versions stores
nothing more). A stored body of an older version is passed through the chain
of upcasters registered for its type, N -> N+1 -> ... -> the class's version,
before it is validated; a body no chain can bring to the class's version (a
newer one, or a missing step) raises :class:`~nmbus.errors.MessageVersionError`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from nmbus.errors import ConfigurationError, MessageVersionError, UndecodableMessage
from nmbus.messages import MAX_VERSION, Message, lookup_type

#: The header that carries a body's version when it is not 1.
VERSION_HEADER = "nmbus-version"

#: ``def upcast(body: dict) -> dict``: a body of version N made into one of N + 1.
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]


def stored_version(headers: str | None) -> int:
    """The version a stored body was sent with, from its raw JSON headers (1 when absent)."""
    if not headers or VERSION_HEADER not in headers:
        return 1
    try:
        value = json.loads(headers).get(VERSION_HEADER)
    except (ValueError, AttributeError):
        return 1
    if value is None:
        return 1
    try:
        version = int(value)
    except (TypeError, ValueError):
        raise MessageVersionError(f"header {VERSION_HEADER} is not a version: {value!r}") from None
    if not 1 <= version <= MAX_VERSION:
        raise MessageVersionError(f"header {VERSION_HEADER} is not a version: {value!r}")
    return version


class Versions:
    """The upcasters of one endpoint, by type name and the version they read."""

    __slots__ = ("_upcasters",)

    def __init__(self) -> None:
        self._upcasters: dict[tuple[str, int], Upcaster] = {}

    def add(self, type_name: str, from_version: int, func: Upcaster) -> None:
        """Register ``func`` to make a ``type_name`` body of ``from_version`` one of the next.

        ConfigurationError for a second upcaster of the same step, or a step
        at or past the version of the class registered under ``type_name``.
        """
        if not isinstance(type_name, str) or not type_name:
            raise ConfigurationError(f"upcaster type name must be a str, got {type_name!r}")
        if (
            isinstance(from_version, bool)
            or not isinstance(from_version, int)
            or not 1 <= from_version < MAX_VERSION
        ):
            raise ConfigurationError(
                f"upcaster from_version must be a whole number from 1, got {from_version!r}"
            )
        if not callable(func):
            raise ConfigurationError(f"upcaster must be callable, got {type(func).__name__}")
        cls = lookup_type(type_name)
        if cls is not None and from_version >= cls.__version__:
            raise ConfigurationError(
                f"upcaster of {type_name} from version {from_version}: the class "
                f"{cls.__qualname__} is version {cls.__version__}, so there is nothing to upcast to"
            )
        key = (type_name, from_version)
        known = self._upcasters.get(key)
        if known is not None:
            raise ConfigurationError(
                f"two upcasters of {type_name} from version {from_version}: "
                f"{getattr(known, '__qualname__', known)!s} and "
                f"{getattr(func, '__qualname__', func)!s}"
            )
        self._upcasters[key] = func

    def upcast(
        self, cls: type[Message], text: str, version: int, *, secret: bool = False
    ) -> str | dict[str, Any]:
        """The body ``text`` of ``version`` as one of ``cls``'s version.

        Returns ``text`` itself when the versions match, else the upcast body
        (a dict). MessageVersionError when no chain leads there; an upcaster's
        own exception becomes UndecodableMessage naming it (with ``secret``, its
        type only: the body may hold decrypted values its message repeats).
        """
        current = cls.__version__
        if version == current:
            return text
        name = cls.__type_name__
        if version > current:
            raise MessageVersionError(
                f"{name} body is version {version}, newer than version {current} this process "
                "knows; deploy the newer code to the consumers first"
            )
        missing = [v for v in range(version, current) if (name, v) not in self._upcasters]
        if missing:
            raise MessageVersionError(
                f"{name} body is version {version} and this process knows version {current}, "
                f"but no upcaster is registered from version {missing[0]}"
            )
        body: Any = json.loads(text)
        for step in range(version, current):
            func = self._upcasters[(name, step)]
            try:
                body = func(body)
            except Exception as exc:
                said = type(exc).__name__ if secret else f"{type(exc).__name__}: {exc}"
                error = UndecodableMessage(
                    f"upcaster {getattr(func, '__qualname__', func)!s} of {name} from version "
                    f"{step} raised {said}"
                )
                if secret:
                    raise error from None
                raise error from exc
            if not isinstance(body, dict):
                raise UndecodableMessage(
                    f"upcaster {getattr(func, '__qualname__', func)!s} of {name} from version "
                    f"{step} returned {type(body).__name__}, not a dict"
                )
        return body  # type: ignore[no-any-return]

    def __bool__(self) -> bool:
        return bool(self._upcasters)
