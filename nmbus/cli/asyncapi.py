"""``nmbus asyncapi module:bus``: print the AsyncAPI 3.0 document of an endpoint.

The Bus is imported (as ``nmbus worker`` imports it) and described: never
started, nothing of it called (a factory, which ``nmbus worker`` takes, is
refused here: it might start something), so nothing connects to a database.
The document is built by nmbus/bus/asyncapi.py.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from nmbus.bus import Bus
from nmbus.bus.asyncapi import document
from nmbus.cli import app
from nmbus.cli._common import fail
from nmbus.cli.worker import load_bus

#: NMBUS_DSN while the module is imported, when it is unset: a Bus that takes its
#: DSN from the environment can then be built. Nothing connects to it (a Bus
#: connects when it starts), and a .invalid host name never resolves (RFC 2606).
PLACEHOLDER_DSN = "postgresql://nmbus-asyncapi.invalid/unused"


@contextmanager
def placeholder_dsn() -> Iterator[None]:
    """NMBUS_DSN set to :data:`PLACEHOLDER_DSN` if it is unset, for the time of the block."""
    if os.environ.get("NMBUS_DSN"):
        yield
        return
    os.environ["NMBUS_DSN"] = PLACEHOLDER_DSN
    try:
        yield
    finally:
        del os.environ["NMBUS_DSN"]


@app.command()
def asyncapi(
    target: Annotated[str, typer.Argument(metavar="MODULE:BUS", help="import path of a Bus")],
    api_version: Annotated[
        str, typer.Option("--api-version", help="the application's version (info.version)")
    ] = "1.0.0",
) -> None:
    """Print the AsyncAPI 3.0 document of a Bus (imported, never started: no database)."""
    with placeholder_dsn():
        bus = load_bus(target)
    if not isinstance(bus, Bus):
        fail(f"{target} is {_kind(bus)}, not a nmbus.Bus: name the Bus itself", 2)
    text = json.dumps(document(bus, api_version), ensure_ascii=False, allow_nan=False, indent=2)
    sys.stdout.write(text + "\n")


def _kind(obj: Any) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__name__}"
    if callable(obj):
        return f"a {type(obj).__name__} (a factory is not called here)"
    return f"a {type(obj).__name__}"
