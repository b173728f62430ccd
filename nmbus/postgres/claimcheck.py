"""The claim check on PostgreSQL: bodies stored apart, and put back when claimed.

A message whose envelope is ``apart`` (its body over ``claim_check_bytes``,
nmbus.envelopes) is inserted with a NULL body and the header
``nmbus-claim-check`` naming the key of its payload. Where the payload goes:

* by default, the schema's table ``"claim$payloads"``, written by the very
  statement that inserts the message (``insert_messages_apart``): both commit
  together or neither does;
* with ``claim_check_store`` (any fsspec URL), a file
  ``<url>/<schema>/<queue>/<key>``, written before that statement, whose row in
  the payloads table (body NULL, url set) commits with the message. A sender
  that dies between the two leaves a file no row knows: retention removes it
  once it is older than ``retention_max_age`` (:func:`sweep`).

A consumer puts the bodies back in the claimed batch with one query, only when
one of its rows carries the header (:func:`resolve`). Retention deletes the
payloads no row refers to any more, files included (:func:`sweep`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog

from nmbus.envelopes import CLAIM_CHECK_BYTES_HEADER, CLAIM_CHECK_HEADER, apart_headers
from nmbus.errors import ConfigurationError, MessageTooLarge
from nmbus.logs import scrub
from nmbus.messages import Envelope, StoredMessage
from nmbus.names import utf8_size
from nmbus.postgres.rows import envelope_arrays, insert_args
from nmbus.postgres.sql import render

log = structlog.get_logger("nmbus.postgres")


def _filesystem(url: str) -> tuple[Any, str]:
    """The fsspec file system of ``url`` and the path in it."""
    try:
        from fsspec.core import url_to_fs
    except ImportError:  # pragma: no cover - depends on the installed extras
        raise ConfigurationError(
            "claim_check_store needs fsspec: pip install 'nmbus[claimcheck]'"
        ) from None
    fs, path = url_to_fs(url)
    return fs, str(path)


@dataclass(slots=True)
class Payloads:
    """The payloads of one insert, as the arrays $13..$16 of insert_messages_apart."""

    keys: list[str]
    bodies: list[str | None]
    urls: list[str | None]
    sizes: list[int]


class ClaimCheck:
    """Where an endpoint's bodies stored apart go: the payloads table, or ``url``."""

    def __init__(self, url: str | None = None) -> None:
        self.url = url.rstrip("/") if url else None
        if self.url is not None:
            # Refused now, not at the first large send: no fsspec, or a protocol it
            # cannot reach (its package missing).
            try:
                _filesystem(self.url)
            except ConfigurationError:
                raise
            except Exception as exc:
                raise ConfigurationError(
                    f"claim_check_store {scrub(self.url)!r} cannot be used: "
                    f"{type(exc).__name__}: {scrub(str(exc)).splitlines()[0] if str(exc) else ''}"
                ) from None

    def __repr__(self) -> str:
        return f"<ClaimCheck store={scrub(self.url) if self.url else 'table'!r}>"

    def folder(self, schema: str, queue: str) -> str | None:
        """The URL of the folder of ``queue``'s files, or None for the table."""
        return None if self.url is None else f"{self.url}/{schema}/{queue}"

    async def prepare(
        self, schema: str, queue: str, envelopes: Sequence[Envelope]
    ) -> tuple[list[Envelope], Payloads]:
        """``envelopes`` with each body that goes apart taken out (its key in its
        headers), and the payloads; a store's files are written here, before the
        statement that inserts the rows."""
        out: list[Envelope] = []
        payloads = Payloads([], [], [], [])
        files: list[tuple[str, str]] = []
        folder = self.folder(schema, queue)
        for envelope in envelopes:
            if not envelope.apart:
                out.append(envelope)
                continue
            key = uuid.uuid4().hex
            size = utf8_size(envelope.msg_text)
            headers = json.loads(envelope.msg_headers) if envelope.msg_headers else {}
            headers[CLAIM_CHECK_HEADER] = key
            headers[CLAIM_CHECK_BYTES_HEADER] = str(size)
            out.append(
                replace(
                    envelope,
                    msg_text=None,  # type: ignore[arg-type]
                    msg_headers=json.dumps(headers, ensure_ascii=False),
                    apart=False,
                )
            )
            payloads.keys.append(key)
            payloads.sizes.append(size)
            if folder is None:
                payloads.bodies.append(envelope.msg_text)
                payloads.urls.append(None)
            else:
                url = f"{folder}/{key}"
                payloads.bodies.append(None)
                payloads.urls.append(url)
                files.append((url, envelope.msg_text))
        if files:
            await asyncio.to_thread(_write_files, files)
        return out, payloads


def has_apart(envelopes: Sequence[Envelope]) -> bool:
    """Whether a body of ``envelopes`` goes apart."""
    return any(e.apart for e in envelopes)


def refuse_apart(queue: str, envelopes: Sequence[Envelope], why: str) -> None:
    """Refuse to store ``envelopes`` in ``queue`` when a body of them goes apart."""
    if has_apart(envelopes):
        raise MessageTooLarge(
            f"a message to {queue!r} has a body over claim_check_bytes, which {why} cannot "
            "store apart; send it to a queue of this database"
        )


async def insert_apart(
    target: Any,
    check: ClaimCheck,
    schema: str,
    queue: str,
    from_endpoint: str,
    envelopes: Sequence[Envelope],
    channel: str,
) -> int:
    """Insert ``envelopes`` into ``queue`` on ``target`` (a connection or the pool),
    their bodies over claim_check_bytes stored apart; one statement."""
    rows, payloads = await check.prepare(schema, queue, envelopes)
    args = insert_args(from_endpoint, queue, envelope_arrays(rows), channel)
    row = await target.fetchrow(
        render("insert_messages_apart", schema, queue),
        *args,
        payloads.keys,
        payloads.bodies,
        payloads.urls,
        payloads.sizes,
    )
    return int(row[0]) if row else 0


def _write_files(files: list[tuple[str, str]]) -> None:
    for url, text in files:
        fs, path = _filesystem(url)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(path, text.encode())


def _read_files(urls: list[str]) -> tuple[dict[str, str], str | None]:
    """The files at ``urls`` that could be read, and the first error of those that
    could not (a file gone is not an error: its payload is just not found)."""
    read: dict[str, str] = {}
    error: str | None = None
    for url in urls:
        try:
            fs, path = _filesystem(url)
            read[url] = fs.cat_file(path).decode()
        except FileNotFoundError:
            pass
        except Exception as exc:  # the store unreachable, refused, or its data bad
            error = error or f"{type(exc).__name__}: {scrub(str(exc))}"
    return read, error


def carries_reference(messages: Sequence[StoredMessage]) -> bool:
    """Whether a row of ``messages`` has its body stored apart (a substring test:
    a batch without one costs nothing more)."""
    return any(m.msg_headers is not None and CLAIM_CHECK_HEADER in m.msg_headers for m in messages)


def reference(headers: str | None) -> str | None:
    """The payload key in a row's headers (JSON text), if its body is stored apart."""
    loaded = apart_headers(headers)
    return None if loaded is None else str(loaded[CLAIM_CHECK_HEADER])


async def resolve(conn: Any, schema: str, queue: str, messages: Sequence[StoredMessage]) -> None:
    """Put back the bodies stored apart of ``messages`` (claimed from ``queue``), in place.

    One query for the batch; the files of a store are read in a thread. A
    payload that cannot be found leaves the body empty: the message then
    fails to decode and goes to F, with its reference still in its headers.
    """
    wanted = {key: m for m in messages if (key := reference(m.msg_headers)) is not None}
    if not wanted:
        return
    rows = await conn.fetch(render("claim_check_payloads", schema), queue, list(wanted))
    urls = {row["url"]: row["key"] for row in rows if row["body"] is None and row["url"]}
    # Never raised: this may run in the transaction that finishes the batch before
    # (finish_and_claim), which a failure here would roll back. A body left unread
    # fails its own message's attempt (the dispatcher), to be tried again.
    read, error = await asyncio.to_thread(_read_files, list(urls)) if urls else ({}, None)
    if error is not None:
        log.warning("claim_check_unreadable", queue=queue, schema=schema, error=error)
    found = 0
    for row in rows:
        body = row["body"] if row["body"] is not None else read.get(row["url"])
        wanted[row["key"]].msg_text = body
        found += body is not None
    if found < len(wanted):
        log.warning("claim_check_missing", queue=queue, missing=len(wanted) - found, schema=schema)


#: How old a store's file no payload row knows must be before retention removes it.
ORPHAN_GRACE = timedelta(hours=1)


async def sweep(
    conn: Any, schema: str, queue: str, store_url: str | None, max_age: timedelta
) -> tuple[int, int]:
    """Delete ``queue``'s payloads no row refers to any more (their files too), and
    the files of the store at ``store_url`` that no payload row knows and that are
    older than ``max_age`` and than ORPHAN_GRACE (a sender died between the file and
    its commit).

    Returns (payloads deleted, orphan files deleted). A queue that never stored
    a body apart costs one probe of the payloads table's primary key.
    """
    deleted = 0
    if await conn.fetchval(render("claim_check_any", schema), queue):
        rows = await conn.fetch(render("claim_check_sweep", schema, queue), queue)
        deleted = len(rows)
        urls = [row["url"] for row in rows if row["url"]]
        if urls:
            await asyncio.to_thread(_remove_files, urls)
    orphans = 0
    folder = ClaimCheck(store_url).folder(schema, queue) if store_url else None
    if folder is not None:
        # A file younger than ORPHAN_GRACE may belong to a send whose transaction is
        # still open, however short the queue's max age (a cleanup --older-than 0s).
        before = datetime.now(UTC) - max(max_age, ORPHAN_GRACE)
        found = await asyncio.to_thread(_old_files, folder, before)
        if found:
            unknown = await conn.fetch(render("claim_check_unknown", schema), queue, list(found))
            gone = [found[row[0]] for row in unknown]
            await asyncio.to_thread(_remove_files, gone)
            orphans = len(gone)
    return deleted, orphans


async def forget_queue(conn: Any, schema: str, queue: str) -> list[str]:
    """Delete every payload of ``queue`` (its table is dropped, in ``conn``'s
    transaction); returns the URLs of their files, to remove once it commits."""
    rows = await conn.fetch(render("claim_check_forget_queue", schema), queue)
    return [row["url"] for row in rows if row["url"]]


async def remove_files(urls: list[str]) -> None:
    """Remove the files at ``urls`` (payloads whose rows were deleted), in a thread."""
    await asyncio.to_thread(_remove_files, urls)


def _remove_files(urls: list[str]) -> None:
    for url in urls:
        fs, path = _filesystem(url)
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(path)


def _modified(info: dict[str, Any]) -> datetime | None:
    for name in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(name)
        if isinstance(value, datetime):
            return value if value.tzinfo else value.replace(tzinfo=UTC)
        if isinstance(value, int | float):
            return datetime.fromtimestamp(value, UTC)
    return None


def _old_files(folder: str, before: datetime) -> dict[str, str]:
    """The files in ``folder`` (key -> URL) last modified before ``before``."""
    fs, path = _filesystem(folder)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return {}
    protocol = folder.split("://", 1)[0]
    found: dict[str, str] = {}
    for info in entries:
        if info.get("type") != "file":
            continue
        when = _modified(info)
        if when is None or when >= before:
            continue
        name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
        found[name] = f"{folder}/{name}" if protocol else str(info["name"])
    return found
