"""Encrypted fields on a real PostgreSQL: sealed in every stored copy, opened
only for the handler, keys kept out of every repr, log and error (docs/messages.md)."""

from __future__ import annotations

import asyncio
import base64
import html
import json
import os
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

import asyncpg
import pyarrow.parquet as pq
import pytest
from pydantic import BaseModel, StringConstraints
from structlog.testing import capture_logs
from typer.testing import CliRunner

from nmbus import (
    Bus,
    Context,
    Encrypted,
    InvalidMessage,
    InvalidSetting,
    Message,
    PermanentError,
    UndecodableMessage,
    UnknownEncryptionKey,
)
from nmbus.cli import app
from nmbus.ports.operations import RetentionPolicy
from nmbus.postgres.forwarder import Forwarder
from nmbus.postgres.retention import clean_queue
from nmbus.settings import Settings
from nmbus.testing import HandlerTest, drain
from tests.dashboard_server import start
from tests.ops_data import split_segments
from tests.pg import Databases

CARD = "4111-1111-SECRET-1111"
KEY1 = bytes(range(32))
KEY2 = bytes(range(100, 132))
KEY9 = bytes(range(200, 224))  # an AES-192 key no receiver holds


class CardCharged(Message, type_name="test.enc.CardCharged"):
    order_id: int
    card_number: Encrypted[str]


class Address(BaseModel):
    street: Encrypted[str]


class Shipped(Message, type_name="test.enc.Shipped"):
    address: Address


def secrets(*keys: bytes) -> list[str]:
    """What must never be found: the plaintext, each key raw, as a repr, base64 and hex."""
    found = [CARD]
    for key in keys:
        found += [key.decode("latin-1"), repr(key)[2:-1], base64.b64encode(key).decode(), key.hex()]
    return found


def assert_none_in(text: str, *keys: bytes) -> None:
    for secret in secrets(*keys):
        assert secret not in text


async def rows(db: asyncpg.Connection, queue: str) -> list[asyncpg.Record]:
    return await db.fetch(
        f'SELECT subqueue, error_info, msg_text, msg_headers FROM nmbus."{queue}" ORDER BY id'
    )


def sealed(text: str, field: str = "card_number") -> dict[str, Any]:
    value: dict[str, Any] = json.loads(text)[field]
    assert set(value) == {"nmbus-encrypted", "data"}
    return value


async def test_a_worker_reads_the_plain_field_that_every_stored_row_and_log_holds_sealed(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str
) -> None:
    keys = {"k2": KEY2, "k1": KEY1}
    bus = make_bus("enc_billing", encryption_keys=keys, encryption_key_id="k2")
    got: list[str] = []

    @bus.handler
    async def charge(msg: CardCharged, ctx: Context) -> None:
        got.append(msg.card_number)

    with capture_logs() as logs:
        async with bus:
            conn = await asyncpg.connect(dsn)
            try:
                async with conn.transaction():  # docs/outbox.md: a send in my transaction
                    await bus.send(
                        CardCharged(order_id=1, card_number=CARD), to="enc_billing", connection=conn
                    )
            finally:
                await conn.close()
            (waiting,) = await rows(db, "enc_billing")
            assert sealed(waiting["msg_text"])["nmbus-encrypted"] == "k2"
            assert_none_in(str(dict(waiting)), KEY1, KEY2)
            await drain(bus)
    assert got == [CARD]
    (done,) = await rows(db, "enc_billing")
    assert done["subqueue"] == "X"
    assert_none_in(str(dict(done)), KEY1, KEY2)
    assert_none_in(repr(bus) + str(bus), KEY1, KEY2)
    assert_none_in(repr(bus.settings) + str(bus.settings), KEY1, KEY2)
    assert_none_in(repr(bus.registry.codec.keys), KEY1, KEY2)
    assert "k1" in repr(bus.settings.encryption_keys)  # the ids, only
    assert_none_in(repr(logs), KEY1, KEY2)


@pytest.fixture
def dsn_b(databases: Databases) -> Iterator[str]:
    with databases.fresh() as fresh:
        yield fresh


@pytest.fixture
async def db_b(dsn_b: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(dsn_b)
    try:
        yield conn
    finally:
        await conn.close()


async def test_the_outbox_and_the_forwarded_copy_hold_only_ciphertext(
    dsn: str, dsn_b: str, db: asyncpg.Connection, db_b: asyncpg.Connection
) -> None:
    orders = Bus(
        "enc_orders",
        dsn=dsn,
        routes={"enc_remote": dsn_b},
        concurrency=0,
        encryption_keys={"k1": KEY1},
    )
    async with orders:
        conn = await asyncpg.connect(dsn)
        try:
            async with conn.transaction():
                await orders.send(
                    CardCharged(order_id=7, card_number=CARD), to="enc_remote", connection=conn
                )
        finally:
            await conn.close()
    (queued,) = await db.fetch("SELECT * FROM nmbus.outbox")
    assert "nmbus-encrypted" in str(dict(queued))
    assert_none_in(str(dict(queued)), KEY1)
    forwarder = Forwarder(dsn, {"enc_remote": dsn_b})
    try:
        assert await forwarder.forward_all() == 1
    finally:
        await forwarder.close()
    (remote,) = await rows(db_b, "enc_remote")
    assert sealed(remote["msg_text"])["nmbus-encrypted"] == "k1"
    assert_none_in(str(dict(remote)), KEY1)
    # The remote endpoint, holding the key, reads it.
    billing = Bus("enc_remote", dsn=dsn_b, encryption_keys={"k1": KEY1}, concurrency=1)
    got: list[str] = []

    @billing.handler
    async def charge(msg: CardCharged, ctx: Context) -> None:
        got.append(msg.card_number)

    async with billing:
        await drain(billing)
    assert got == [CARD]


async def test_old_messages_still_open_after_a_new_key_becomes_current(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    async with make_bus("enc_sender", concurrency=0, encryption_keys={"k1": KEY1}) as old:
        await old.send(CardCharged(order_id=1, card_number=CARD), to="enc_rotated")
    bus = make_bus("enc_rotated", encryption_keys={"k2": KEY2, "k1": KEY1}, encryption_key_id="k2")
    got: list[tuple[int, str]] = []

    @bus.handler
    async def charge(msg: CardCharged, ctx: Context) -> None:
        got.append((msg.order_id, msg.card_number))

    async with bus:
        await bus.send(CardCharged(order_id=2, card_number=CARD), to="enc_rotated")
        await drain(bus)
    assert sorted(got) == [(1, CARD), (2, CARD)]
    stored = await rows(db, "enc_rotated")
    assert [sealed(r["msg_text"])["nmbus-encrypted"] for r in stored] == ["k1", "k2"]
    assert [r["subqueue"] for r in stored] == ["X", "X"]


async def test_an_unknown_key_id_fails_the_message_at_once_naming_the_id_only(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    async with make_bus("enc_other", concurrency=0, encryption_keys={"k9": KEY9}) as other:
        await other.send(CardCharged(order_id=1, card_number=CARD), to="enc_unknown")
    bus = make_bus("enc_unknown", encryption_keys={"k1": KEY1}, dead_letter="enc_dead")
    ran: list[int] = []

    @bus.handler
    async def charge(msg: CardCharged, ctx: Context) -> None:
        ran.append(msg.order_id)

    with capture_logs() as logs:
        async with bus:
            await drain(bus)
    assert ran == []
    (failed,) = await rows(db, "enc_unknown")
    assert failed["subqueue"] == "F"
    assert failed["error_info"].startswith("UnknownEncryptionKey: ")
    assert "'k9'" in failed["error_info"].splitlines()[0]
    assert sealed(failed["msg_text"])["nmbus-encrypted"] == "k9"
    (copy,) = await rows(db, "enc_dead")
    assert copy["msg_text"] == failed["msg_text"]
    for text in (str(dict(failed)), str(dict(copy)), repr(logs)):
        assert_none_in(text, KEY1, KEY9)


async def test_an_operator_sees_an_encrypted_field_as_its_key_id(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str
) -> None:
    async with make_bus("enc_other", concurrency=0, encryption_keys={"k9": KEY9}) as other:
        await other.send(CardCharged(order_id=1, card_number=CARD), to="enc_shown")
    bus = make_bus("enc_shown", encryption_keys={"k1": KEY1})
    bus.handler(CardCharged)(_ignore)
    async with bus:
        await drain(bus)
    (ident,) = [r["id"] for r in await db.fetch('SELECT id FROM nmbus."enc_shown"')]
    argv = ["failed", "show", "enc_shown", str(ident), "--dsn", dsn]
    shown = await asyncio.to_thread(CliRunner().invoke, app, argv, env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.stdout
    assert "[encrypted, key k9]" in shown.stdout
    assert "nmbus-encrypted" not in shown.stdout
    assert_none_in(shown.stdout, KEY9)
    raw = await asyncio.to_thread(CliRunner().invoke, app, [*argv, "--json"])
    assert sealed(json.loads(raw.stdout)["msg_text"])["nmbus-encrypted"] == "k9"
    server = await start(dsn)
    try:
        status, page, _ = await asyncio.to_thread(server.get, f"/failed/enc_shown/{ident}")
    finally:
        server.proc.terminate()
        server.proc.wait(15)
        for stream in (server.proc.stdout, server.proc.stderr):
            if stream is not None:
                stream.close()
    assert status == 200
    assert "[encrypted, key k9]" in html.unescape(page)
    assert_none_in(html.unescape(page), KEY9)


async def _ignore(msg: CardCharged, ctx: Context) -> None:
    raise AssertionError("never opened")


async def test_a_tampered_value_fails_at_once_naming_the_field(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    keys = {"k1": KEY1}
    async with make_bus("enc_sender2", concurrency=0, encryption_keys=keys) as sender:
        await sender.send(CardCharged(order_id=1, card_number=CARD), to="enc_tampered")
        await sender.send(CardCharged(order_id=2, card_number=CARD), to="enc_tampered")
    (first, second) = await db.fetch('SELECT id, msg_text FROM nmbus."enc_tampered" ORDER BY id')
    body = json.loads(first["msg_text"])
    data = bytearray(base64.b64decode(body["card_number"]["data"]))
    data[-1] ^= 1
    body["card_number"]["data"] = base64.b64encode(bytes(data)).decode()
    await db.execute(
        'UPDATE nmbus."enc_tampered" SET msg_text = $2 WHERE id = $1', first["id"], json.dumps(body)
    )
    body2 = json.loads(second["msg_text"])
    body2["order_id"] = 3  # fields beside it may change: only the field is bound
    await db.execute(
        'UPDATE nmbus."enc_tampered" SET msg_text = $2 WHERE id = $1',
        second["id"],
        json.dumps(body2),
    )
    bus = make_bus("enc_tampered", encryption_keys=keys)
    ran: list[int] = []

    @bus.handler
    async def charge(msg: CardCharged, ctx: Context) -> None:
        ran.append(msg.order_id)

    async with bus:
        await drain(bus)
    assert ran == [3]
    failed, done = await rows(db, "enc_tampered")
    assert (failed["subqueue"], done["subqueue"]) == ("F", "X")
    line = failed["error_info"].splitlines()[0]
    assert line.startswith("UndecodableMessage: test.enc.CardCharged.card_number")


def test_a_value_sealed_for_one_field_does_not_open_in_another() -> None:
    class Twice(Message, type_name="test.enc.Twice"):
        a: Encrypted[str]
        b: Encrypted[str]

    bus = Bus("enc_unit", dsn="postgresql://x@127.0.0.1/x", encryption_keys={"k1": KEY1})
    text, _ = bus.registry.codec.encode(Twice(a="one", b="two"))
    body = json.loads(text)
    assert bus.registry.codec.decode(Twice, text, None) == Twice(a="one", b="two")
    body["a"], body["b"] = body["b"], body["a"]
    with pytest.raises(Exception, match=r"test\.enc\.Twice\.a: its encrypted value"):
        bus.registry.codec.decode(Twice, json.dumps(body), None)


async def test_a_bus_without_a_key_refuses_to_send_an_encrypted_field(
    make_bus: Callable[..., Bus],
) -> None:
    async with make_bus("enc_nokey", concurrency=0) as bus:
        with pytest.raises(InvalidMessage, match="no encryption key"):
            await bus.send(CardCharged(order_id=1, card_number=CARD), to="enc_nokey")
    async with make_bus("enc_nested", concurrency=0, encryption_keys={"k1": KEY1}) as bus:
        with pytest.raises(InvalidMessage, match=r"Address\.street is Encrypted inside"):
            await bus.send(Shipped(address=Address(street="x")), to="enc_nested")


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"encryption_keys": {"k1": KEY1[:10]}}, "must be 16, 24 or 32 bytes"),
        ({"encryption_keys": "k1:" + base64.b64encode(KEY1).decode()[:-3] + "!!"}, "base64"),
        ({"encryption_keys": {"k1": KEY1}, "encryption_key_id": "k7"}, "'k7' is not among"),
        ({"encryption_keys": {"k1": KEY1, "k2": KEY2}}, "must name the key"),
        ({"encryption_key_id": "k1"}, "needs encryption_keys"),
        ({"encryption_keys": {"bad id!": KEY1}}, "a key id is"),
    ],
)
def test_bad_keys_are_refused_without_showing_a_key(values: dict[str, Any], says: str) -> None:
    with pytest.raises(InvalidSetting, match=says) as caught:
        Bus("enc_bad", dsn="postgresql://x@127.0.0.1/x", **values)
    text = str(caught.value) + repr(caught.value) + repr(caught.value.__cause__)
    assert_none_in(text, KEY1, KEY2)
    assert_none_in(text.replace("k1:", ""), KEY1[:10])


def test_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    one, two = (base64.b64encode(k).decode() for k in (KEY1, KEY2))
    monkeypatch.setenv("NMBUS_ENCRYPTION_KEYS", f"k1:{one}, k2:{two}")
    monkeypatch.setenv("NMBUS_ENCRYPTION_KEY_ID", "k2")
    settings = Settings()
    keys = settings.encryption_keys
    assert keys is not None
    assert (keys.ids, keys.current, keys.key("k1")) == (("k1", "k2"), "k2", KEY1)
    assert_none_in(repr(settings) + str(settings) + repr(keys), KEY1, KEY2)
    dumped = settings.model_dump_json()
    assert json.loads(dumped)["encryption_keys"] == {"ids": ["k1", "k2"], "current": "k2"}
    assert_none_in(dumped, KEY1, KEY2)
    monkeypatch.setenv("NMBUS_ENCRYPTION_KEYS", f"k1={one}")
    with pytest.raises(Exception, match="id:<base64 key> pairs") as caught:
        Settings()
    assert one not in str(caught.value)


async def test_handler_test_opens_the_fields_the_bus_sealed() -> None:
    bus = Bus("enc_unit", dsn="postgresql://x@127.0.0.1/x", encryption_keys={"k1": KEY1})
    got: list[str] = []

    @bus.handler
    async def charge(msg: CardCharged, ctx: Context) -> None:
        got.append(msg.card_number)
        if msg.order_id == 2:
            raise PermanentError("declined")

    await HandlerTest(bus).handle(CardCharged(order_id=1, card_number=CARD))
    assert got == [CARD]
    no_key = Bus("enc_unit", dsn="postgresql://x@127.0.0.1/x")
    no_key.handler(CardCharged)(charge)
    with pytest.raises(InvalidMessage, match="no encryption key"):
        await HandlerTest(no_key).handle(CardCharged(order_id=1, card_number=CARD))


class Short(Message, type_name="test.enc.Short"):
    code: Encrypted[Annotated[str, StringConstraints(max_length=4)]]


def test_a_decrypted_value_that_does_not_validate_is_not_repeated() -> None:
    bus = Bus("enc_unit", dsn="postgresql://x@127.0.0.1/x", encryption_keys={"k1": KEY1})
    text, _ = bus.registry.codec.encode(Short.model_construct(code=CARD))
    with pytest.raises(UndecodableMessage, match="code: String should have at most 4") as caught:
        bus.registry.codec.decode(Short, text, None)
    assert caught.value.__cause__ is None and caught.value.__context__ is None
    assert_none_in(str(caught.value), KEY1)


def test_unknown_key_is_a_message_error_naming_no_key() -> None:
    bus = Bus("enc_unit", dsn="postgresql://x@127.0.0.1/x", encryption_keys={"k9": KEY9})
    text, _ = bus.registry.codec.encode(CardCharged(order_id=1, card_number=CARD))
    reader = Bus(
        "enc_unit", dsn="postgresql://x@127.0.0.1/x", encryption_keys={"k1": os.urandom(32)}
    )
    with pytest.raises(UnknownEncryptionKey, match="key id 'k9'") as caught:
        reader.registry.codec.decode(CardCharged, text, None)
    assert_none_in(str(caught.value), KEY9)


async def test_the_parquet_archive_holds_only_ciphertext(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, tmp_path: Path
) -> None:
    bus = make_bus("enc_archived", encryption_keys={"k1": KEY1})
    got: list[str] = []

    @bus.handler
    async def charge(msg: CardCharged, ctx: Context) -> None:
        got.append(msg.card_number)

    async with bus:
        await bus.send(CardCharged(order_id=1, card_number=CARD), to="enc_archived")
        await drain(bus)
    assert got == [CARD]
    await split_segments(db, "true", queue="enc_archived")
    policy = RetentionPolicy(max_age=timedelta(0), archive_dir=tmp_path)
    result = await clean_queue(db, "nmbus", "enc_archived", policy)
    assert result.deleted["X"] == 1
    (archived,) = pq.read_table(result.files[0]).to_pylist()
    assert sealed(archived["msg_text"])["nmbus-encrypted"] == "k1"
    assert_none_in(str(archived), KEY1)
