"""Message versions and upcasters on a real PostgreSQL (docs/messages.md,
"Versions and upcasters"): the version travels in the ``nmbus-version`` header
(absent for version 1), an older body is upcast through its chain before it is
validated, and a body no chain can read fails at once (F)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from typer.testing import CliRunner

from nmbus import (
    Bus,
    ConfigurationError,
    Context,
    Encrypted,
    Message,
    MessageError,
    MessageVersionError,
)
from nmbus.bus.asyncapi import message_version
from nmbus.cli import app
from nmbus.contracts import Codec
from nmbus.testing import HandlerTest, MemoryStore, drain
from tests import dashboard_server as dashboard
from tests import procs
from tests.waits import wait_until

# A row's version, as an operator asks for it.
VERSION_SQL = "coalesce((msg_headers->>'nmbus-version')::int, 1)"


def order(name: str, version: int) -> type[Message]:
    """Release ``version`` of message type ``name``: one qualified name for all of them,
    as the same class is in the code of each release."""
    if version == 1:

        class Order(Message, type_name=name):
            n: int

    elif version == 2:

        class Order(Message, type_name=name, version=2):  # type: ignore[no-redef]
            n: int
            currency: str

    else:

        class Order(Message, type_name=name, version=3):  # type: ignore[no-redef]
            n: int
            currency: str
            region: str

    return Order


def upcast(bus: Bus, name: str, *steps: int) -> None:
    """Register the upcasters of ``name`` from each version in ``steps``."""
    if 1 in steps:

        @bus.upcaster(name, from_version=1)
        def add_currency(body: dict[str, Any]) -> dict[str, Any]:
            return {**body, "currency": "EUR"}

    if 2 in steps:

        @bus.upcaster(name, from_version=2)
        def add_region(body: dict[str, Any]) -> dict[str, Any]:
            return {**body, "region": "eu" if body["currency"] == "EUR" else "other"}


async def rows(db: asyncpg.Connection, queue: str) -> list[asyncpg.Record]:
    return await db.fetch(
        f"SELECT subqueue, retry_count, error_info, msg_headers, {VERSION_SQL} AS version "
        f'FROM nmbus."{queue}" ORDER BY id'
    )


async def test_an_old_body_is_upcast_through_its_chain_in_a_real_worker(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    name = "versions.chain.Order"
    v1, v2, v3 = order(name, 1), order(name, 2), order(name, 3)
    bus = make_bus("versions_chain")
    upcast(bus, name, 1, 2)
    seen: list[tuple[int, str, str]] = []

    @bus.handler(v3)
    async def handle(msg: Any, ctx: Context) -> None:
        seen.append((msg.n, msg.currency, msg.region))

    async with bus:
        await bus.send(v1(n=1), to="versions_chain")
        await bus.send(v2(n=2, currency="USD"), to="versions_chain")
        await bus.send(v3(n=3, currency="USD", region="us"), to="versions_chain")
        await drain(bus)
    assert sorted(seen) == [(1, "EUR", "eu"), (2, "USD", "other"), (3, "USD", "us")]
    found = await rows(db, "versions_chain")
    assert [(r["subqueue"], r["version"]) for r in found] == [("X", 1), ("X", 2), ("X", 3)]
    # Version 1 carries no header: a queue that uses no versions stores nothing more.
    assert found[0]["msg_headers"] is None or "nmbus-version" not in json.loads(
        found[0]["msg_headers"]
    )
    assert json.loads(found[1]["msg_headers"])["nmbus-version"] == "2"


async def test_a_newer_body_fails_at_once_naming_both_versions(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str
) -> None:
    name = "versions.newer.Order"
    v3 = order(name, 3)
    v2 = order(name, 2)  # this process's class: the last defined
    bus = make_bus("versions_newer")
    upcast(bus, name, 1)
    seen: list[int] = []

    @bus.handler(v2)
    async def handle(msg: Any, ctx: Context) -> None:
        seen.append(msg.n)

    async with bus:
        await bus.send(v3(n=1, currency="EUR", region="eu"), to="versions_newer")
        await drain(bus)
    assert seen == []
    (row,) = await rows(db, "versions_newer")
    assert (row["subqueue"], row["retry_count"]) == ("F", 1)
    first = row["error_info"].splitlines()[0]
    assert first.startswith("MessageVersionError: ")
    assert "version 3" in first and "version 2" in first
    # An operator sees the body's version beside its type.
    row_id = await db.fetchval('SELECT id FROM nmbus."versions_newer"')
    shown = await asyncio.to_thread(
        CliRunner().invoke,
        app,
        ["failed", "show", "versions_newer", str(row_id), "--dsn", dsn],
        env={"COLUMNS": "200", "NMBUS_DSN": None},
    )
    assert shown.exit_code == 0, shown.stdout
    assert re.search(r"^\s*version\s+3\s*$", shown.stdout, re.MULTILINE), shown.stdout
    # And so does the dashboard's message page.
    server = await dashboard.start(dsn)
    try:
        status, page, _ = await asyncio.to_thread(server.get, f"/failed/versions_newer/{row_id}")
    finally:
        server.proc.terminate()
        server.proc.wait(15)
        for stream in (server.proc.stdout, server.proc.stderr):
            if stream is not None:
                stream.close()
    assert status == 200 and '<td id="version">3</td>' in page, page[-2000:]


async def test_an_old_body_with_no_complete_chain_fails_at_once(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    name = "versions.gap.Order"
    v1 = order(name, 1)
    v3 = order(name, 3)
    bus = make_bus("versions_gap")
    upcast(bus, name, 1)  # no step from 2

    @bus.handler(v3)
    async def handle(msg: Any, ctx: Context) -> None: ...

    async with bus:
        await bus.send(v1(n=1), to="versions_gap")
        await drain(bus)
    (row,) = await rows(db, "versions_gap")
    assert (row["subqueue"], row["retry_count"]) == ("F", 1)
    first = row["error_info"].splitlines()[0]
    assert first.startswith("MessageVersionError: ")
    assert "version 1" in first and "version 3" in first and "from version 2" in first


async def test_an_upcaster_that_raises_fails_the_message_at_once_naming_it(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    name = "versions.broken.Order"
    v1 = order(name, 1)
    v2 = order(name, 2)
    bus = make_bus("versions_broken")

    @bus.upcaster(name, from_version=1)
    def broken(body: dict[str, Any]) -> dict[str, Any]:
        raise KeyError("currency")

    @bus.handler(v2)
    async def handle(msg: Any, ctx: Context) -> None: ...

    async with bus:
        await bus.send(v1(n=1), to="versions_broken")
        await drain(bus)
    (row,) = await rows(db, "versions_broken")
    assert (row["subqueue"], row["retry_count"]) == ("F", 1)
    first = row["error_info"].splitlines()[0]
    assert first.startswith("UndecodableMessage: ")
    assert "broken" in first and "KeyError" in first


async def test_handler_test_applies_the_upcasters() -> None:
    name = "versions.ht.Order"
    v1 = order(name, 1)
    v3 = order(name, 3)
    bus = Bus("versions_ht", store=MemoryStore())
    upcast(bus, name, 1, 2)
    seen: list[tuple[int, str, str]] = []

    @bus.handler(v3)
    async def handle(msg: Any, ctx: Context) -> None:
        seen.append((msg.n, msg.currency, msg.region))

    outcome = await HandlerTest(bus).handle(v1(n=7))
    assert outcome.processed
    assert seen == [(7, "EUR", "eu")]


def test_versions_and_upcasters_are_checked_when_registered() -> None:
    name = "versions.reg.Order"
    order(name, 2)
    bus = Bus("versions_reg", store=MemoryStore())
    upcast(bus, name, 1)
    with pytest.raises(ConfigurationError, match=r"two upcasters of versions\.reg\.Order"):
        upcast(bus, name, 1)
    with pytest.raises(ConfigurationError, match="is version 2, so there is nothing"):
        upcast(bus, name, 2)
    for bad in (0, -1, True, "2", 1.5):
        with pytest.raises(ConfigurationError, match="invalid version"):

            class Bad(Message, type_name="versions.reg.Bad", version=bad):  # type: ignore[misc]
                n: int

    assert issubclass(MessageVersionError, MessageError)
    assert message_version(order("versions.reg.Three", 3)) == 3
    assert message_version(order("versions.reg.One", 1)) == 1


async def test_a_rolling_deploy_old_senders_and_a_new_worker_at_once(
    dsn: str, db: asyncpg.Connection
) -> None:
    await db.execute("CREATE TABLE versions_seen (n int, currency text)")
    count = 200
    worker = procs.Proc("tests.versions_workers", "new", dsn, "versions_roll")
    sender: procs.Proc | None = None
    try:
        await worker.wait_for("ready")
        sender = procs.Proc("tests.versions_workers", "old", dsn, "versions_roll", str(count))
        await sender.wait_for("done")
        await wait_until(
            "SELECT count(*) FROM versions_seen", db=db, until=lambda n: n == count, timeout=60
        )
    finally:
        if sender is not None:
            sender.kill()
        worker.kill()
    seen = await db.fetch("SELECT n, currency FROM versions_seen ORDER BY n")
    assert [(r["n"], r["currency"]) for r in seen] == [(n, "EUR") for n in range(count)]
    found = await rows(db, "versions_roll")
    assert {(r["subqueue"], r["version"]) for r in found} == {("X", 1)}
    assert all(
        r["msg_headers"] is None or "nmbus-version" not in json.loads(r["msg_headers"])
        for r in found
    )


def test_the_docs_example_runs(tmp_path: Path) -> None:
    """docs/messages.md, "Versions and upcasters": its Python block runs as written."""
    root = Path(__file__).resolve().parent.parent
    page = (root / "docs" / "messages.md").read_text(encoding="utf-8")
    section = page.split("## Versions and upcasters", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"^```python\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    (tmp_path / "test_example.py").write_text(code, encoding="utf-8")
    done = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:nmbus",
            "-o", "asyncio_mode=auto", "-o", "asyncio_default_fixture_loop_scope=function",
            "-W", "error", "test_example.py",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr


async def test_upcasters_see_encrypted_fields_in_the_clear_and_never_leak_them(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    secret = "4111-VERSIONS-SECRET"

    def card(version: int) -> type[Message]:
        if version == 1:

            class Card(Message, type_name="versions.enc.Card"):
                number: Encrypted[str]

        else:

            class Card(Message, type_name="versions.enc.Card", version=2):  # type: ignore[no-redef]
                number: Encrypted[str]
                last4: str

        return Card

    v1, v2 = card(1), card(2)
    bus = make_bus("versions_enc", encryption_keys={"k1": bytes(range(32))})
    seen: list[str] = []

    @bus.upcaster("versions.enc.Card", from_version=1)
    def add_last4(body: dict[str, Any]) -> dict[str, Any]:
        if body["number"].endswith("BAD"):
            raise ValueError(f"cannot read {body['number']}")
        return {**body, "last4": body["number"][-4:]}

    @bus.handler(v2)
    async def handle(msg: Any, ctx: Context) -> None:
        seen.append(msg.last4)

    async with bus:
        await bus.send(v1(number=secret), to="versions_enc")
        await bus.send(v1(number=secret + "BAD"), to="versions_enc")
        await drain(bus)
    assert seen == ["CRET"]
    found = await db.fetch(
        'SELECT subqueue, error_info, msg_text FROM nmbus."versions_enc" ORDER BY id'
    )
    assert [r["subqueue"] for r in found] == ["X", "F"]
    assert found[1]["error_info"].startswith("UndecodableMessage: upcaster ")
    assert "ValueError" in found[1]["error_info"]
    assert all(secret not in (r["error_info"] or "") + r["msg_text"] for r in found)


async def test_a_newer_body_reaching_a_version_1_class_fails_at_once(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    """A version-1 class with no encrypted field is validated without the codec, but
    only for a body without the version header: a newer body still fails at once."""
    name = "versions.fast.newer.Order"
    v2 = order(name, 2)
    v1 = order(name, 1)  # this process's class: an older release
    bus = make_bus("versions_fast_newer")
    seen: list[int] = []

    @bus.handler(v1)
    async def handle(msg: Any, ctx: Context) -> None:
        seen.append(msg.n)

    async with bus:
        await bus.send(v1(n=1), to="versions_fast_newer")
        await bus.send(v2(n=2, currency="EUR"), to="versions_fast_newer")
        await drain(bus)
    assert seen == [1]
    found = await rows(db, "versions_fast_newer")
    assert [(r["subqueue"], r["version"]) for r in found] == [("X", 1), ("F", 2)]
    first = found[1]["error_info"].splitlines()[0]
    assert first.startswith("MessageVersionError: ")
    assert "version 2" in first and "version 1" in first


async def test_older_bodies_are_upcast_beside_a_type_decoded_without_the_codec(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one queue: a plain version-1 type skips the codec; a version-3 type with
    upcasters still upcasts a version-1 body (no header) and a version-2 body."""
    name = "versions.fast.Order"
    v1, v2, v3 = order(name, 1), order(name, 2), order(name, 3)

    class Plain(Message, type_name="versions.fast.Plain"):
        n: int

    decoded: list[str] = []
    real = Codec.decode

    def counted(self: Codec, cls: type[Message], text: str, headers: str | None) -> Message:
        decoded.append(cls.__type_name__)
        return real(self, cls, text, headers)

    monkeypatch.setattr(Codec, "decode", counted)
    bus = make_bus("versions_fast")
    upcast(bus, name, 1, 2)
    seen: list[tuple[int, str, str]] = []
    plain: list[int] = []

    @bus.handler(v3)
    async def handle(msg: Any, ctx: Context) -> None:
        seen.append((msg.n, msg.currency, msg.region))

    @bus.handler(Plain)
    async def handle_plain(msg: Plain, ctx: Context) -> None:
        plain.append(msg.n)

    async with bus:
        for n in range(3):
            await bus.send(Plain(n=n), to="versions_fast")
        await bus.send(v1(n=1), to="versions_fast")
        await bus.send(v2(n=2, currency="USD"), to="versions_fast")
        await bus.send(Plain(n=3), to="versions_fast")
        await drain(bus)
    assert sorted(seen) == [(1, "EUR", "eu"), (2, "USD", "other")]
    assert plain == [0, 1, 2, 3]
    assert {r["subqueue"] for r in await rows(db, "versions_fast")} == {"X"}
    # The plain type's bodies were validated without the codec; the others through it.
    assert decoded == [name, name]


async def test_failed_show_json_gives_the_version_as_a_number(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str
) -> None:
    name = "versions.show.Order"
    v1, v3 = order(name, 1), order(name, 3)
    bus = make_bus("versions_show")
    async with bus:  # no handler: the rows stay as sent
        await bus.send(v1(n=1), to="versions_show")
        await bus.send(v3(n=3, currency="EUR", region="eu"), to="versions_show")
        await bus.send(v1(n=4), to="versions_show")
    ids = [r["id"] for r in await db.fetch('SELECT id FROM nmbus."versions_show" ORDER BY id')]
    # A header written by hand that holds no version.
    await db.execute(
        'UPDATE nmbus."versions_show" SET msg_headers = \'{"nmbus-version": "x"}\' WHERE id = $1',
        ids[2],
    )

    def show(row_id: int, *json_flag: str) -> str:
        shown = CliRunner().invoke(
            app,
            ["failed", "show", "versions_show", str(row_id), "--dsn", dsn, *json_flag],
            env={"COLUMNS": "200", "NMBUS_DSN": None},
        )
        assert shown.exit_code == 0, shown.stdout
        return shown.stdout

    found = []
    for row_id in ids:
        data = json.loads(await asyncio.to_thread(show, row_id, "--json"))
        found.append(data["version"])
        # Beside the type, as the table prints it.
        keys = list(data)
        assert keys[keys.index("label") + 1] == "version"
    assert found == [1, 3, None]
    printed = await asyncio.to_thread(show, ids[1])
    assert re.search(r"^\s*version\s+3\s*$", printed, re.MULTILINE), printed
