"""Which ``Host:`` headers the dashboard answers: the standard library only.

Kept apart from the application so that ``nmbus dashboard`` can check its
``--host`` before it imports anything of the ``nmbus[dashboard]`` extra.
"""

from __future__ import annotations

import ipaddress

# The names a browser on this machine uses for a loopback dashboard.
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is an address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name of a ``Host:`` header without its port: ``[::1]:8787`` -> ``::1``."""
    value = header.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else value
    if value.count(":") == 1:
        return value.partition(":")[0]
    return value  # a bare name, or an IPv6 address without brackets (and so without port)


def loopback_names(host: str) -> tuple[str, ...] | None:
    """The ``Host:`` names a dashboard listening on ``host`` answers (None: any).

    On a loopback address only this machine's own names: a page of another
    site whose DNS name was rebound to a loopback address sends its own name
    and is refused, whichever loopback address (127.x, ::1, localhost) it is.
    """
    if not is_loopback(host):
        return None
    own = host_name(f"[{host.strip('[]')}]" if ":" in host else host)
    return tuple(dict.fromkeys((*LOCAL_NAMES, own)))
