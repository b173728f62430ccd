"""The claim check on a real PostgreSQL (docs/messages.md, "Claim check"): a body over
claim_check_bytes is stored apart, the row keeps its key, the handler, the failure
port's copy and a requeue see the whole message, retention removes the payload
with its message, and a sender killed between the payload and its commit leaves
no message without its payload."""

from __future__ import annotations

import asyncio
import hashlib
import html
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pyarrow.parquet as pq
import pytest
import structlog
from typer.testing import CliRunner

from nmbus import (
    Bus,
    ConfigurationError,
    Context,
    Encrypted,
    InvalidSetting,
    Message,
    MessageTooLarge,
    PermanentError,
    RetryPolicy,
)
from nmbus.cli import app
from nmbus.envelopes import CLAIM_CHECK_BYTES_HEADER, CLAIM_CHECK_HEADER, outgoing
from nmbus.ops.admin import Admin
from nmbus.ports.operations import RetentionPolicy
from nmbus.ports.store import SCHEMA_VERSION
from nmbus.postgres.retention import clean_queue
from nmbus.postgres.schema import install_schema
from nmbus.testing import HandlerTest, MemoryStore, drain
from tests.dashboard_server import start
from tests.ops_data import split_segments
from tests.pg import Databases
from tests.procs import Proc
from tests.waits import wait_until

MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def _keep_logging_config() -> Iterator[None]:
    """The CLI configures structlog for the process; give other tests theirs back."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


class Blob(Message, type_name="test.cc.Blob"):
    data: str
    fail: bool = False


class Secret(Message, type_name="test.cc.Secret"):
    card: Encrypted[str]
    padding: str


async def rows(db: asyncpg.Connection, queue: str = "media") -> list[asyncpg.Record]:
    return await db.fetch(
        f'SELECT id, subqueue, msg_text, msg_headers::text AS headers FROM nmbus."{queue}" '
        "ORDER BY id"
    )


async def payloads(db: asyncpg.Connection, queue: str = "media") -> list[asyncpg.Record]:
    return await db.fetch(
        'SELECT key, body, url, bytes FROM nmbus."claim$payloads" WHERE queue = $1 ORDER BY key',
        queue,
    )


# The open transactions that wrote into the payloads table and wait, uncommitted.
WRITING_PAYLOADS = """
    SELECT count(*) FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid)
    WHERE l.relation = 'nmbus."claim$payloads"'::regclass AND l.mode = 'RowExclusiveLock'
      AND a.state = 'idle in transaction'
"""


def key_of(headers: str) -> str:
    return str(json.loads(headers)[CLAIM_CHECK_HEADER])


async def test_a_body_over_claim_check_bytes_is_stored_apart_and_handled_whole(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("media", claim_check_bytes=1000)
    got: list[str] = []

    @bus.handler
    async def handle(msg: Blob, ctx: Context) -> None:
        got.append(msg.data)

    big, small = "é" * 3000, "s" * 100
    async with bus:
        await bus.send(Blob(data=big), to="media")
        await bus.send(Blob(data=small), to="media")
        stored = await rows(db)
        # The big body is not in its row: its key is, with its size; the small one stays.
        assert stored[0]["msg_text"] is None
        headers = json.loads(stored[0]["headers"])
        body = Blob(data=big).model_dump_json()
        assert headers[CLAIM_CHECK_BYTES_HEADER] == str(len(body.encode()))
        assert stored[1]["msg_text"] == Blob(data=small).model_dump_json()
        assert stored[1]["headers"] is None or CLAIM_CHECK_HEADER not in stored[1]["headers"]
        (payload,) = await payloads(db)
        assert payload["key"] == headers[CLAIM_CHECK_HEADER]
        assert payload["body"] == body and payload["url"] is None
        await drain(bus)
    assert sorted(got) == sorted([big, small])


async def test_the_send_limit_stays_without_a_claim_check_and_holds_for_the_headers(
    make_bus: Callable[..., Bus],
) -> None:
    plain = make_bus("media", concurrency=0)
    checked = make_bus("media", concurrency=0, claim_check_bytes=1000, max_message_bytes=4096)
    async with plain, checked:
        with pytest.raises(MessageTooLarge, match="NMBUS_MAX_MESSAGE_BYTES"):
            await plain.send(Blob(data="x" * (2 * MiB)), to="media")
        # With the claim check the body goes apart; the headers still count.
        await checked.send(Blob(data="x" * (2 * MiB)), to="media")
        with pytest.raises(MessageTooLarge, match="headers"):
            await checked.send(Blob(data="x" * 10), to="media", headers={"h": "y" * 5000})
        with pytest.raises(MessageTooLarge, match="published"):
            await checked.publish(Blob(data="x" * 5000))


async def test_a_body_stored_apart_is_refused_for_a_routed_queue_at_the_send(
    make_bus: Callable[..., Bus], databases: Databases, db: asyncpg.Connection
) -> None:
    with databases.fresh() as other:
        bus = make_bus("media", claim_check_bytes=1000, routes={"remote": other})
        refused: list[str] = []

        @bus.handler
        async def handle(msg: Blob, ctx: Context) -> None:
            try:
                await ctx.send(Blob(data="r" * 5000), to="remote")
            except MessageTooLarge as exc:
                refused.append(str(exc))
            await ctx.send(Blob(data="small"), to="remote")

        async with bus:
            with pytest.raises(MessageTooLarge, match="routed to another database"):
                await bus.send(Blob(data="r" * 5000), to="remote")
            await bus.send(Blob(data="go"), to="media")
            await drain(bus)
        assert len(refused) == 1 and "routed" in refused[0]
        # The handler's other send went through; nothing of the large one was written.
        assert await db.fetchval("SELECT count(*) FROM nmbus.outbox") == 1
        assert await db.fetchval("SELECT subqueue FROM nmbus.media") == "X"


async def test_a_64_mib_message_goes_end_to_end(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("media", claim_check_bytes=256_000, lease_seconds=60.0)
    data = os.urandom(32 * MiB).hex()  # 64 MiB of text
    digests: list[tuple[int, str]] = []

    @bus.handler
    async def handle(msg: Blob, ctx: Context) -> None:
        digests.append((len(msg.data), hashlib.sha256(msg.data.encode()).hexdigest()))

    async with bus:
        await bus.send(Blob(data=data), to="media")
        await drain(bus, timeout=120)
    assert digests == [(64 * MiB, hashlib.sha256(data.encode()).hexdigest())]
    assert [r["subqueue"] for r in await rows(db)] == ["X"]


async def test_an_encrypted_field_reaches_the_payload_sealed(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus(
        "media",
        claim_check_bytes=1000,
        encryption_keys={"k1": bytes(range(32))},
        encryption_key_id="k1",
    )
    got: list[str] = []

    @bus.handler
    async def handle(msg: Secret, ctx: Context) -> None:
        got.append(msg.card)

    async with bus:
        await bus.send(Secret(card="4111-SECRET", padding="p" * 5000), to="media")
        (payload,) = await payloads(db)
        assert "p" * 5000 in payload["body"] and "4111-SECRET" not in payload["body"]
        await drain(bus)
    assert got == ["4111-SECRET"]


async def test_the_failure_port_copy_and_a_requeue_carry_the_whole_message(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str
) -> None:
    bus = make_bus("media", claim_check_bytes=1000, dead_letter="media_failed")
    port = make_bus("media_failed")
    seen: list[tuple[str, int]] = []

    @bus.handler
    async def handle(msg: Blob, ctx: Context) -> None:
        seen.append(("media", len(msg.data)))
        if msg.fail and len(seen) == 1:
            raise PermanentError("not now")

    @port.handler
    async def copied(msg: Blob, ctx: Context) -> None:
        seen.append(("port", len(msg.data)))

    async with bus, port:
        await bus.send(Blob(data="x" * 5000, fail=True), to="media")
        await drain(bus)
        await drain(port)
        (failed,) = await rows(db)
        assert failed["subqueue"] == "F"
        # The copy's body is stored apart again, under a key of its own queue.
        (copy,) = await rows(db, "media_failed")
        assert copy["msg_text"] is None
        assert key_of(copy["headers"]) != key_of(failed["headers"])
        assert [p["key"] for p in await payloads(db, "media_failed")] == [key_of(copy["headers"])]
        # An operator sees that the body is stored apart, and its size.
        argv = ["failed", "show", "media", str(failed["id"]), "--dsn", dsn]
        shown = await asyncio.to_thread(CliRunner().invoke, app, argv, env={"COLUMNS": "300"})
        assert shown.exit_code == 0, shown.output
        note = f"[stored apart: 5023 bytes, key {key_of(failed['headers'])}]"
        assert note in shown.stdout
        server = await start(dsn)
        try:
            status, page, _ = await asyncio.to_thread(server.get, f"/failed/media/{failed['id']}")
        finally:
            server.proc.terminate()
            server.proc.wait(15)
            for stream in (server.proc.stdout, server.proc.stderr):
                if stream is not None:
                    stream.close()
        assert status == 200 and note in html.unescape(page)
        async with Admin(dsn) as admin:
            assert await admin.requeue_failed("media", ids=[failed["id"]]) == 1
        await drain(bus)
    assert seen == [("media", 5000), ("port", 5000), ("media", 5000)]


async def test_retention_removes_a_payload_with_its_message_and_keeps_a_moved_ones(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    handled: list[int] = []

    def media() -> Bus:
        bus = make_bus("media", claim_check_bytes=1000)

        @bus.handler
        async def handle(msg: Blob, ctx: Context) -> None:
            handled.append(len(msg.data))
            if msg.fail and len(handled) == 1:
                raise PermanentError("later")

        return bus

    async with media() as bus:
        await bus.send(Blob(data="f" * 5000, fail=True), to="media")
        await drain(bus)
        await bus.send(Blob(data="x" * 6000), to="media")
        await drain(bus)
    failed, done = await rows(db)
    assert (failed["subqueue"], done["subqueue"]) == ("F", "X")
    assert len(await payloads(db)) == 2
    # Every row in an old segment: the X row's segment is dropped, the F row moved.
    await split_segments(db, "true", queue="media")
    result = await clean_queue(db, "nmbus", "media", RetentionPolicy(max_age=timedelta(0)))
    assert result.segments_dropped >= 1 and result.rows_moved == 1
    assert result.payloads_deleted == 1
    assert [p["key"] for p in await payloads(db)] == [key_of(failed["headers"])]
    # The moved row still finds its payload: requeued, it is handled whole.
    (moved,) = await rows(db)
    await db.execute("UPDATE nmbus.media SET subqueue = 'I', retry_time = now() WHERE id = $1",
                     moved["id"])  # fmt: skip
    async with media() as bus:
        await drain(bus)
    assert handled == [5000, 6000, 5000]
    # Purged, its payload goes at the next run.
    await db.execute("DELETE FROM nmbus.media")
    result = await clean_queue(db, "nmbus", "media", RetentionPolicy(max_age=timedelta(0)))
    assert result.payloads_deleted == 1 and await payloads(db) == []


async def test_a_store_of_files_holds_the_payload_and_retention_removes_it(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, tmp_path: Path, dsn: str
) -> None:
    store = f"file://{tmp_path}/payloads"
    bus = make_bus("media", claim_check_bytes=1000, claim_check_store=store)
    got: list[str] = []

    @bus.handler
    async def handle(msg: Blob, ctx: Context) -> None:
        got.append(msg.data)

    async with bus:
        await bus.send(Blob(data="q" * 5000), to="media")
        (row,) = await rows(db)
        (payload,) = await payloads(db)
        key = key_of(row["headers"])
        path = tmp_path / "payloads" / "nmbus" / "media" / key
        assert payload["body"] is None and payload["url"] == f"{store}/nmbus/media/{key}"
        assert path.read_text() == Blob(data="q" * 5000).model_dump_json()
        await drain(bus)
    assert got == ["q" * 5000]
    await db.execute("DELETE FROM nmbus.media")
    # A file no payload row knows, two hours old (a sender died before its commit).
    stray = path.with_name("0" * 32)
    stray.write_text("{}")
    os.utime(stray, (time.time() - 7200, time.time() - 7200))
    # nmbus cleanup, the store from the environment as every setting.
    argv = ["cleanup", "media", "--older-than", "1h", "--yes", "--json", "--dsn", dsn]
    env = {"NMBUS_CLAIM_CHECK_STORE": store, "NMBUS_DSN": None}
    done = await asyncio.to_thread(CliRunner().invoke, app, argv, env=env)
    assert done.exit_code == 0, done.output
    (result,) = json.loads(done.stdout)["queues"]
    assert (result["payloads_deleted"], result["orphans_deleted"]) == (1, 1)
    assert not path.exists() and not stray.exists() and await payloads(db) == []


async def test_a_sender_killed_before_its_commit_leaves_neither_row_nor_payload(
    dsn: str, db: asyncpg.Connection
) -> None:
    async with Bus("media", dsn=dsn, concurrency=0):
        pass  # the queue exists: the sender's transaction writes rows only
    sender = Proc("tests.claimcheck_sender", dsn, "table", "5000")
    try:
        await sender.wait_for("sent ")
        # The payload and the row are written, in the sender's open transaction.
        assert await db.fetchval(WRITING_PAYLOADS) == 1
        assert await rows(db) == [] and await payloads(db) == []
    finally:
        sender.kill()
    await wait_until(lambda: db.fetchval(f"SELECT ({WRITING_PAYLOADS}) = 0"))
    assert await rows(db) == [] and await payloads(db) == []


async def test_a_sender_killed_after_its_file_leaves_an_orphan_that_retention_removes(
    dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    store = f"file://{tmp_path}"
    async with Bus("media", dsn=dsn, concurrency=0):
        pass
    sender = Proc("tests.claimcheck_sender", dsn, store, "5000")
    try:
        await sender.wait_for("sent ")
    finally:
        sender.kill()
    (orphan,) = (tmp_path / "nmbus" / "media").iterdir()
    assert await rows(db) == [] and await payloads(db) == []
    policy = RetentionPolicy(max_age=timedelta(hours=1), claim_check_store=store)
    # Younger than the max age, it may still be on its way to a commit: kept.
    assert (await clean_queue(db, "nmbus", "media", policy)).orphans_deleted == 0
    assert orphan.exists()
    # However short the max age: a send's transaction may be open for a while yet.
    at_once = RetentionPolicy(max_age=timedelta(0), claim_check_store=store)
    assert (await clean_queue(db, "nmbus", "media", at_once)).orphans_deleted == 0
    assert orphan.exists()
    # A known payload's file, however old, stays.
    bus = Bus("media", dsn=dsn, concurrency=0, claim_check_bytes=1000, claim_check_store=store)
    async with bus:
        await bus.send(Blob(data="k" * 5000), to="media")
    known = [p for p in (tmp_path / "nmbus" / "media").iterdir() if p != orphan]
    old = time.time() - 7200
    for path in (orphan, *known):
        os.utime(path, (old, old))
    result = await clean_queue(db, "nmbus", "media", policy)
    assert result.orphans_deleted == 1 and result.payloads_deleted == 0
    assert not orphan.exists() and all(p.exists() for p in known)


async def test_a_queue_without_claim_checks_never_reads_the_payloads(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    bus = make_bus("media")

    @bus.handler
    async def handle(msg: Blob, ctx: Context) -> None:
        pass

    async with bus:
        for n in range(20):
            await bus.send(Blob(data=str(n)), to="media", headers={"k": "v"})
        await drain(bus)
    await asyncio.sleep(1.2)  # backends flush their statistics within a second
    await db.execute("SELECT pg_stat_clear_snapshot()")
    scans = await db.fetchval(
        "SELECT coalesce(seq_scan, 0) + coalesce(idx_scan, 0) FROM pg_stat_user_tables "
        "WHERE schemaname = 'nmbus' AND relname = 'claim$payloads'"
    )
    assert scans == 0


async def test_a_version_15_database_gets_the_payloads_table(
    dsn: str, db: asyncpg.Connection
) -> None:
    async with Bus("media", dsn=dsn, concurrency=0):
        pass
    await db.execute('DROP TABLE nmbus."claim$payloads"')
    await db.execute("DELETE FROM nmbus.schema_version")
    await db.execute("INSERT INTO nmbus.schema_version (version) VALUES (15)")
    await install_schema(db, "nmbus")
    assert await db.fetchval("SELECT max(version) FROM nmbus.schema_version") == SCHEMA_VERSION
    async with Bus("media", dsn=dsn, concurrency=0, claim_check_bytes=1000) as bus:
        await bus.send(Blob(data="m" * 5000), to="media")
    (payload,) = await payloads(db)
    assert payload["bytes"] == len(Blob(data="m" * 5000).model_dump_json())


def test_the_docs_example_runs(dsn: str, tmp_path: Path) -> None:
    """docs/messages.md, "Claim check": its Python block runs as written, on a database."""
    root = Path(__file__).resolve().parent.parent
    page = (root / "docs" / "messages.md").read_text(encoding="utf-8")
    section = page.split("## Claim check", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"^```python\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    (tmp_path / "test_example.py").write_text(code, encoding="utf-8")
    done = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:nmbus",
            "-o", "asyncio_mode=auto", "-o", "asyncio_default_fixture_loop_scope=function",
            "-W", "error", "test_example.py",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(root), "NMBUS_DSN": dsn},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr


def test_settings_come_from_the_environment_and_a_bad_store_is_refused_at_once(
    monkeypatch: pytest.MonkeyPatch, dsn: str
) -> None:
    monkeypatch.setenv("NMBUS_CLAIM_CHECK_BYTES", "300000")
    monkeypatch.setenv("NMBUS_CLAIM_CHECK_STORE", "file:///tmp/nmbus-payloads")
    bus = Bus("media", dsn=dsn)
    assert bus.settings.claim_check_bytes == 300_000
    assert bus.envelopes.claim_check_bytes == 300_000
    monkeypatch.delenv("NMBUS_CLAIM_CHECK_STORE")
    for value, error in [
        ({"claim_check_bytes": 10}, "claim_check_bytes (NMBUS_CLAIM_CHECK_BYTES)"),
        ({"claim_check_bytes": 2**40}, "claim_check_bytes (NMBUS_CLAIM_CHECK_BYTES)"),
        ({"claim_check_store": "/shared/x"}, "fsspec URL"),
        ({"claim_check_bytes": 2 * MiB}, "must be below max_message_bytes"),
    ]:
        with pytest.raises(InvalidSetting, match=re.escape(error)):
            Bus("media", dsn=dsn, **value)
    # A protocol fsspec does not know: refused when the bus is built, its secret hidden.
    with pytest.raises(ConfigurationError, match="claim_check_store") as refused:
        Bus("media", dsn=dsn, claim_check_store="nosuch://user:hunter2@host/x")
    assert "hunter2" not in str(refused.value)
    assert "hunter2" not in repr(
        Bus("media", dsn=dsn, claim_check_store="file://user:hunter2@/tmp/x").settings
    )


async def test_a_unique_id_sent_twice_stores_one_row_and_one_payload(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    async with make_bus("media", concurrency=0, claim_check_bytes=1000) as bus:
        for _ in range(2):
            await bus.send(Blob(data="u" * 5000), to="media", unique_id="upload-7")
        # In one transaction too: the second copy's payload is dropped with its row.
        async with bus.store.pool.acquire() as conn, conn.transaction():  # type: ignore[attr-defined]
            await bus.send(Blob(data="u" * 5000), to="media", unique_id="upload-7", connection=conn)
    (row,) = await rows(db)
    assert [p["key"] for p in await payloads(db)] == [key_of(row["headers"])]


async def test_the_archive_holds_the_reference_not_the_payload(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, tmp_path: Path
) -> None:
    bus = make_bus("media", claim_check_bytes=1000)

    @bus.handler
    async def handle(msg: Blob, ctx: Context) -> None:
        pass

    async with bus:
        await bus.send(Blob(data="a" * 5000), to="media")
        await drain(bus)
    (row,) = await rows(db)
    await split_segments(db, "true", queue="media")
    policy = RetentionPolicy(max_age=timedelta(0), archive_dir=tmp_path)
    result = await clean_queue(db, "nmbus", "media", policy)
    assert result.payloads_deleted == 1 and await payloads(db) == []
    (archived,) = pq.read_table(tmp_path).to_pylist()
    assert archived["msg_text"] is None
    assert key_of(archived["msg_headers"]) == key_of(row["headers"])


async def test_a_handler_test_keeps_the_body_whole_and_refuses_the_same_publish() -> None:
    bus = Bus("media", store=MemoryStore(), claim_check_bytes=1000)
    sizes: list[int] = []

    @bus.handler
    async def handle(msg: Blob, ctx: Context) -> None:
        sizes.append(len(msg.data))
        await ctx.send(Blob(data="c" * 5000), to="thumbnails")
        if msg.fail:
            await ctx.publish(Blob(data="p" * 5000))

    t = HandlerTest(bus)
    assert (await t.handle(Blob(data="h" * 5000))).processed
    assert [len(s.message.data) for s in t.sent] == [5000]  # type: ignore[attr-defined]
    failed = await t.handle(Blob(data="h" * 5000, fail=True))
    # Refused in the handler, as the worker would: its exception, retried by the policy.
    assert failed.status == "retry" and "MessageTooLarge" in (failed.error_info or "")
    assert sizes == [5000, 5000]


async def test_every_batch_of_a_backlog_gets_its_bodies_back(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    # Batches of 2 over a backlog: the first claimed alone, the next ones by the
    # statement that finishes the batch before them.
    async with make_bus("media", concurrency=0, claim_check_bytes=1000) as sender:
        for n in range(7):
            await sender.send(Blob(data=str(n) * (3000 + n)), to="media")
    bus = make_bus("media", claim_check_bytes=1000, batch_size=2)
    got: list[str] = []

    @bus.handler
    async def handle(msg: Blob, ctx: Context) -> None:
        got.append(msg.data)

    async with bus:
        await drain(bus)
    assert sorted(got) == [str(n) * (3000 + n) for n in range(7)]


async def test_a_payload_gone_from_its_store_fails_its_message_as_its_policy_says_and_no_other(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, tmp_path: Path
) -> None:
    store = f"file://{tmp_path}"
    async with make_bus("media", concurrency=0, claim_check_bytes=1000,
                        claim_check_store=store) as sender:  # fmt: skip
        await sender.send(Blob(data="g" * 5000), to="media")
        await sender.send(Blob(data="k" * 5000), to="media")
    gone, _ = await rows(db)
    (tmp_path / "nmbus" / "media" / key_of(gone["headers"])).unlink()
    bus = make_bus("media", claim_check_bytes=1000, claim_check_store=store)
    got: list[str] = []

    @bus.handler(retry=1)
    async def handle(msg: Blob, ctx: Context) -> None:
        got.append(msg.data)

    async with bus:
        await drain(bus)
    assert got == ["k" * 5000]
    failed = await db.fetchrow("SELECT subqueue, error_info FROM nmbus.media WHERE id = $1",
                               gone["id"])  # fmt: skip
    assert failed["subqueue"] == "F"
    assert failed["error_info"].startswith(
        f"StoreError: its body [stored apart: 5024 bytes, key {key_of(gone['headers'])}]"
        " was not found or could not be read"
    )


async def test_a_store_that_cannot_be_read_costs_an_attempt_and_never_the_batch_before(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, tmp_path: Path
) -> None:
    """The next batch's bodies are read by the finish of the batch before, in its
    transaction: a store that fails there must not roll that finish back (its
    handler would run again); the unreadable message is tried again later."""
    store = f"file://{tmp_path}"
    async with make_bus("media", concurrency=0, claim_check_bytes=1000,
                        claim_check_store=store) as sender:  # fmt: skip
        await sender.send(Blob(data="small"), to="media")
        await sender.send(Blob(data="b" * 5000), to="media")
    _, big = await rows(db)
    path = tmp_path / "nmbus" / "media" / key_of(big["headers"])
    body = path.read_text()
    # A directory where the file was: reading it fails, and not as "not found".
    path.unlink()
    path.mkdir()
    # One message a batch: the finish of the first claims the second.
    bus = make_bus("media", claim_check_bytes=1000, claim_check_store=store, batch_size=1)
    runs: list[str] = []

    @bus.handler(retry=RetryPolicy(max_attempts=20, initial_delay=0.3, backoff=1, jitter=0))
    async def handle(msg: Blob, ctx: Context) -> None:
        runs.append(msg.data[:5])

    async with bus:
        sql = "SELECT retry_count FROM nmbus.media WHERE id = $1 AND subqueue = 'R'"
        await wait_until(sql, big["id"], db=db, until=lambda n: n is not None and n >= 1)
        path.rmdir()
        path.write_text(body)
        await wait_until(lambda: len(runs) == 2, timeout=30)
        await drain(bus)
    assert runs == ["small", "bbbbb"]
    done = await db.fetch("SELECT subqueue FROM nmbus.media ORDER BY id")
    assert [r["subqueue"] for r in done] == ["X", "X"]


async def test_two_batches_of_the_same_big_messages_in_opposite_orders_do_not_deadlock(
    dsn: str, db: asyncpg.Connection
) -> None:
    """As test_unique_windows.py's test of the same name, for bodies stored apart: two
    batches (one statement each) of the same unique ids in opposite orders, at once."""
    ids = [f"big-{n:02d}" for n in range(30)]
    async with Bus("media", dsn=dsn, concurrency=0, claim_check_bytes=1000) as bus:
        await bus.send(Blob(data="first"), to="media")  # the queue's table

        def batch(order: list[str]) -> list[Any]:
            return [
                bus.envelopes.for_send(Blob(data=uid * 300), "media", outgoing({"unique_id": uid}))
                for uid in order
            ]

        first, second = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
        try:
            for _ in range(15):
                await db.execute("DELETE FROM nmbus.media WHERE unique_id LIKE 'big-%'")
                # Built afresh: each stored body gets a payload key of its own.
                forward, backward = batch(ids), batch(ids[::-1])
                assert all(e.apart for e in forward)
                stored = await asyncio.gather(
                    bus.store.insert("media", "media", forward, first),
                    bus.store.insert("media", "media", backward, second),
                )
                assert sorted(stored) == [0, len(ids)]
        finally:
            await first.close()
            await second.close()
    assert await db.fetchval("SELECT count(*) FROM nmbus.media WHERE unique_id LIKE 'big-%'") == 30
    # One payload for each row stored in a round (the rows deleted since keep theirs
    # until retention), none for the sends dropped as duplicates.
    assert await db.fetchval('SELECT count(*) FROM nmbus."claim$payloads"') == 15 * 30


async def test_a_big_message_failing_into_a_routed_failure_port_reaches_f_and_its_copy_whole(
    dsn: str, db: asyncpg.Connection, databases: Databases
) -> None:
    """The outbox of a route carries whole rows: the failure port's copy of a body
    stored apart goes there whole, and the original goes to F once."""
    runs: list[int] = []
    with databases.fresh() as remote:
        bus = Bus("media", dsn=dsn, claim_check_bytes=1000, dead_letter="media_failed",
                  routes={"media_failed": remote}, concurrency=1)  # fmt: skip

        @bus.handler
        async def handle(msg: Blob, ctx: Context) -> None:
            runs.append(1)
            raise PermanentError("not now")

        async with bus:
            await bus.send(Blob(data="r" * 5000), to="media")
            sql = "SELECT count(*) FROM nmbus.media WHERE subqueue = 'F'"
            await wait_until(sql, db=db, until=lambda n: n == 1)
            await wait_until("SELECT count(*) FROM nmbus.outbox", db=db, until=lambda n: n == 0)
        far = await asyncpg.connect(remote)
        try:
            (copy,) = await far.fetch(
                "SELECT msg_text, msg_headers::text AS h FROM nmbus.media_failed"
            )
        finally:
            await far.close()
    assert runs == [1]
    assert copy["msg_text"] == Blob(data="r" * 5000).model_dump_json()
    assert CLAIM_CHECK_HEADER not in copy["h"]


async def test_dropping_a_queue_drops_its_payloads_and_their_files(
    make_bus: Callable[..., Bus], db: asyncpg.Connection, dsn: str, tmp_path: Path
) -> None:
    store = f"file://{tmp_path}"
    async with make_bus("media", concurrency=0, claim_check_bytes=1000,
                        claim_check_store=store) as bus:  # fmt: skip
        await bus.send(Blob(data="d" * 5000), to="media")
        await bus.send(Blob(data="d" * 5000), to="other")
    folder = tmp_path / "nmbus" / "media"
    assert len(list(folder.iterdir())) == 1
    async with Admin(dsn) as admin:
        assert await admin.drop_queues(["media"]) == ["media"]
    assert list(folder.iterdir()) == [] and await payloads(db) == []
    assert len(await payloads(db, "other")) == 1
