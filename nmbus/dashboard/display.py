"""How the dashboard's templates show figures, times and texts."""

from __future__ import annotations

import json
import re
from datetime import datetime

from nmbus.contracts.versions import VERSION_HEADER, stored_version
from nmbus.errors import MessageVersionError

_VERSION = re.compile(r'"' + re.escape(VERSION_HEADER) + r'": "(\d{1,7})"')


def version(headers: str | None, *, cut: bool = False) -> str:
    """A message's version from its headers' JSON text (no nmbus-version header: 1);
    ``cut`` headers are searched as text, "?" for a header that is not a version."""
    if cut:
        found = _VERSION.search(headers or "")
        return found[1] if found else "1"
    try:
        return str(stored_version(headers))
    except MessageVersionError:
        return "?"


def pretty(text: str | None) -> str:
    if text is None:
        return ""
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        return text


def seconds(value: float | None) -> str:
    if value is None:
        return "–"
    if value < 120:
        return f"{value:.1f} s"
    if value < 7200:
        return f"{value / 60:.1f} min"
    if value < 172800:
        return f"{value / 3600:.1f} h"
    return f"{value / 86400:.1f} d"


def number(value: float | None, estimated: bool = False) -> str:
    if value is None:
        return "–"
    text = f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"
    return f"≈{text}" if estimated else text


def ms(value: float | None) -> str:
    return "–" if value is None else f"{value:,.1f}"


def utc(value: datetime | None, empty: str = "–") -> str:
    return empty if value is None else f"{value:%Y-%m-%d %H:%M:%S} UTC"


def size(chars: int) -> str:
    return f"{chars:,} characters"


_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def disk(size_bytes: int) -> str:
    """A size on disk in binary units (``40.0 KiB``, ``56.6 MiB``)."""
    for unit, scale in _UNITS:
        if size_bytes >= scale:
            return f"{size_bytes / scale:,.1f} {unit}"
    return f"{size_bytes:,} B"
