"""The forwarder: moves outbox rows to the queues that live in other databases.

A send or publish to a routed queue writes a row into ``{schema}.outbox`` of
the sender's database, in the sender's transaction (see ``outbox_insert``).
The forwarder moves those rows, one destination queue at a time, in order:

1. In a local transaction, take the queue's forwarding lock
   (``pg_try_advisory_xact_lock``: one forwarder per queue at a time, so
   order is kept; a busy queue is tried again shortly) and read its oldest
   rows (``outbox_take``).
2. In a transaction on the remote database, insert them into the queue table
   with ``insert_messages``: the queue's unique table (a unique_id is stored once) makes a
   second copy of a row impossible. Commit.
3. Only then delete the rows from the outbox and commit locally.

A forwarder killed between 2 and 3 leaves the rows in the outbox (the local
transaction dies with its connection); the next forwarder inserts them again,
and the remote unique index stores nothing twice. A rolled-back sender never
wrote a row, so nothing of it can reach the remote. A remote database that is
down only makes its rows wait: the forwarder backs off (up to
``reconnect_max``) for that database alone and tries again by itself.

Wake-ups come from ``NOTIFY`` on the outbox channel (sent at the sender's
commit), with a fallback poll every ``poll_interval`` seconds. Connections:
one for the outbox, one for LISTEN, one per remote database. Behind a
transaction pooler (``pooler``, nmbus/postgres/pooler.py) every connection
prepares nothing, and LISTEN goes to its ``listen_dsn`` or is left out: the
poll every ``poll_interval`` is then the only wake-up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import structlog

from nmbus.errors import DatabaseUnavailable
from nmbus.logs import log_failure, scrub
from nmbus.maintenance.supervise import Backoff
from nmbus.names import validate_queue_name, validate_schema_name
from nmbus.postgres.connections import server_settings
from nmbus.postgres.errors import is_connection_error, wrap_errors
from nmbus.postgres.listen import listen_loop, notify_channel
from nmbus.postgres.pooler import Pooler
from nmbus.postgres.pubsub import install_publish_function
from nmbus.postgres.rows import insert_args, insert_sql, outbox_arrays
from nmbus.postgres.sql import render
from nmbus.postgres.store import ensure_queue_on, install_schema

log = structlog.get_logger("nmbus.forwarder")

# A queue whose lock another forwarder holds is looked at again after this long
# (that queue alone: the others of its database are not held back).
BUSY_RETRY = 0.2
# Longest wait for one remote statement before the remote is treated as down.
REMOTE_TIMEOUT = 30.0


class RemoteUnavailable(DatabaseUnavailable):
    """A remote database failed while rows were moved to it; they stay in the outbox."""


@dataclass(slots=True)
class _Remote:
    """One remote database: its connection and, after a failure, its backoff."""

    dsn: str
    backoff: Backoff
    conn: asyncpg.Connection | None = None
    known: set[str] = field(default_factory=set)
    retry_at: float = 0.0
    error: str | None = None


@dataclass(slots=True)
class ForwardStats:
    """What a forwarder has done since it started (for tools and tests)."""

    taken: int = 0  # outbox rows moved (inserted remotely or already there)
    inserted: int = 0  # rows the remote stored (taken - inserted were already there)
    failures: int = 0  # remote failures


class Forwarder:
    """Moves the outbox of the database at ``dsn`` to the databases of ``routes``.

    ``routes`` maps a queue to the DSN of its database. Rows for a queue that
    is not in ``routes`` stay in the outbox (``nmbus status`` shows them) until
    a forwarder that knows the route runs.
    """

    def __init__(
        self,
        dsn: str,
        routes: Mapping[str, str],
        *,
        schema: str = "nmbus",
        batch_size: int = 500,
        poll_interval: float = 5.0,
        reconnect_max: float = 10.0,
        pooler: Pooler | None = None,
    ) -> None:
        self.dsn = dsn
        self.pooler = pooler or Pooler()
        self.schema = validate_schema_name(schema)
        self.routes = {validate_queue_name(q): target for q, target in routes.items()}
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self.reconnect_max = reconnect_max
        self.stats = ForwardStats()
        self._remotes: dict[str, _Remote] = {}
        for target in self.routes.values():
            self._remotes.setdefault(target, _Remote(target, Backoff(reconnect_max)))
        self._local: asyncpg.Connection | None = None
        self._wake = asyncio.Event()
        self._pending: set[str] = set(self.routes)
        # A queue another forwarder holds is looked at again from then on, alone:
        # the other queues of its database go on meanwhile.
        self._busy_until: dict[str, float] = {}

    def __repr__(self) -> str:
        dsn = scrub(self.dsn)
        return f"<Forwarder schema={self.schema!r} dsn={dsn!r} queues={len(self.routes)}>"

    # -- running -------------------------------------------------------------------------

    async def run(self) -> None:
        """Forward until cancelled (a supervised side task of the bus, or ``nmbus forward``)."""
        log.info(
            "forwarder_started",
            queues=sorted(self.routes),
            databases=sorted(scrub(r.dsn) for r in self._remotes.values()),
        )
        listener = asyncio.create_task(self._listen(), name="nmbus-forwarder-listen")
        try:
            while True:
                await self._wait()
                await self.forward_pending()
        finally:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
            await self.close()

    async def forward_all(self) -> int:
        """Forward every row waiting now (for tools and tests); returns rows taken.

        Raises RemoteUnavailable when a remote database cannot take its rows.
        """
        self._pending = set(self.routes)
        taken = 0
        while self._pending:
            queues, self._pending = sorted(self._pending), set()
            for queue in queues:
                remote = self._remotes[self.routes[queue]]
                moved = await self._forward_queue(queue, remote)
                if moved is None:
                    self._pending.add(queue)
                    await asyncio.sleep(BUSY_RETRY)
                else:
                    taken += moved
        return taken

    async def close(self) -> None:
        for conn in [self._local, *(r.conn for r in self._remotes.values())]:
            if conn is not None:
                conn.terminate()
        self._local = None
        for remote in self._remotes.values():
            remote.conn = None

    def wake(self, queue: str = "*") -> None:
        if queue == "*":
            self._pending.update(self.routes)
        elif queue in self.routes:
            self._pending.add(queue)
        else:
            return
        self._wake.set()

    async def _wait(self) -> None:
        loop = asyncio.get_running_loop()
        timeout = self.poll_interval
        if self._pending:
            due = [self._due(q) for q in self._pending]
            if min(due) <= loop.time():
                return
            soonest = min(due)
            timeout = min(timeout, max(0.0, soonest - loop.time()))
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            self.wake("*")

    async def forward_pending(self) -> None:
        """One pass over the queues woken so far; failures leave them pending."""
        loop = asyncio.get_running_loop()
        queues, self._pending = sorted(self._pending), set()
        for queue in queues:
            remote = self._remotes[self.routes[queue]]
            if self._due(queue) > loop.time():
                self._pending.add(queue)
                continue
            try:
                moved = await self._forward_queue(queue, remote)
            except RemoteUnavailable:
                self._pending.add(queue)
                continue
            if moved is None:
                self._pending.add(queue)
                self._busy_until[queue] = loop.time() + BUSY_RETRY
            else:
                self._busy_until.pop(queue, None)

    def _due(self, queue: str) -> float:
        """When ``queue`` can be tried: its database's backoff, or its own busy pause."""
        return max(self._remotes[self.routes[queue]].retry_at, self._busy_until.get(queue, 0.0))

    # -- one queue -----------------------------------------------------------------------

    async def _forward_queue(self, queue: str, remote: _Remote) -> int | None:
        """Move ``queue``'s rows until none is left; None when another forwarder has it."""
        local = await self._local_conn()
        moved = 0
        while True:
            with wrap_errors("forward from the outbox"):
                async with local.transaction():
                    key = f"nmbus.outbox.{self.schema}.{queue}"
                    if not await local.fetchval(render("try_advisory_lock", self.schema), key):
                        return None
                    rows = await local.fetch(
                        render("outbox_take", self.schema), queue, self.batch_size
                    )
                    if not rows:
                        return moved
                    connected = remote.conn is not None and not remote.conn.is_closed()
                    if connected:
                        inserted = await self._deliver(remote, queue, rows)
                        await local.execute(
                            render("outbox_done", self.schema), [r[0] for r in rows]
                        )
            if not connected:
                # Connecting can take up to its timeout when the remote hangs: never
                # with the outbox rows locked in an open transaction, which would
                # hold back vacuum in the sender's database for the whole outage.
                await self._connect(remote)
                continue
            self.stats.taken += len(rows)
            self.stats.inserted += inserted
            moved += len(rows)
            if len(rows) < self.batch_size:
                return moved

    async def _deliver(self, remote: _Remote, queue: str, rows: Sequence[Any]) -> int:
        """Insert ``rows`` into ``queue`` on ``remote`` and commit; returns rows stored."""
        conn = await self._connect(remote)
        try:
            inserted = 0
            async with conn.transaction():
                await ensure_queue_on(conn, self.schema, queue, remote.known)
                for start, end in _runs(rows):
                    part = rows[start:end]
                    row = await conn.fetchrow(
                        insert_sql(self.schema, queue, len(part)),
                        *_remote_args(part, queue, notify_channel(self.schema)),
                    )
                    inserted += int(row[0]) if row else 0
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise self._unavailable(remote, exc) from exc
        remote.known.add(queue)  # committed: its table exists from now on
        if remote.error is not None:
            log.info("forwarding_resumed", database=scrub(remote.dsn))
        remote.error = None
        remote.backoff.reset()
        return inserted

    async def _connect(self, remote: _Remote) -> asyncpg.Connection:
        """The remote's connection; a failure pauses the remote (RemoteUnavailable)."""
        try:
            return await self._remote_conn(remote)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise self._unavailable(remote, exc) from exc

    def _unavailable(self, remote: _Remote, exc: BaseException) -> RemoteUnavailable:
        self._remote_failed(remote, exc, asyncio.get_running_loop().time())
        return RemoteUnavailable(f"forward to {scrub(remote.dsn)}: {remote.error}")

    def _remote_failed(self, remote: _Remote, exc: BaseException, now: float) -> None:
        self.stats.failures += 1
        if remote.conn is not None:
            remote.conn.terminate()
            remote.conn = None
        remote.known.clear()
        remote.retry_at = now + remote.backoff.next()
        first = remote.error is None
        remote.error = scrub(f"{type(exc).__name__}: {exc}")
        if first:
            # Once per outage, not per attempt: the backlog is in `nmbus status`.
            if is_connection_error(exc) or is_connection_error(exc.__cause__ or exc):
                log.warning("forwarding_paused", database=scrub(remote.dsn), error=remote.error)
            else:
                log_failure(log, "forwarding_failed", exc, "warning", database=scrub(remote.dsn))

    # -- connections ---------------------------------------------------------------------

    async def _local_conn(self) -> asyncpg.Connection:
        if self._local is None or self._local.is_closed():
            with wrap_errors("connect to the outbox's database"):
                self._local = await asyncpg.connect(
                    self.dsn,
                    timeout=10,
                    server_settings=server_settings(self.dsn, "forward"),
                    **self.pooler.connect_options(),
                )
        return self._local

    async def _remote_conn(self, remote: _Remote) -> asyncpg.Connection:
        if remote.conn is None or remote.conn.is_closed():
            conn = await asyncpg.connect(
                remote.dsn,
                timeout=10,
                command_timeout=REMOTE_TIMEOUT,
                server_settings=server_settings(remote.dsn, "forward"),
                **self.pooler.connect_options(),
            )
            try:
                await install_schema(conn, self.schema)
                await install_publish_function(conn, self.schema)
            except BaseException:
                conn.terminate()
                raise
            remote.conn = conn
        return remote.conn

    async def _listen(self) -> None:
        """LISTEN on the outbox channel; after a reconnection, look at every queue."""
        if not self.pooler.listens:
            return  # behind a transaction pooler without listen_dsn: the poll wakes it
        dsn = self.pooler.listen_on(self.dsn)
        await listen_loop(
            lambda: asyncpg.connect(
                dsn, timeout=10, server_settings=server_settings(dsn, "forward-listen")
            ),
            notify_channel(self.schema, outbox=True),
            self.wake,
            self.reconnect_max,
            log,
            lost="forwarder_listener_lost",
            failed=None,
        )


def _runs(rows: Sequence[Any]) -> list[tuple[int, int]]:
    """Index ranges of consecutive rows with the same sender (insert_messages takes one)."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i][1] != rows[start][1]:
            runs.append((start, i))
            start = i
    return runs


def _remote_args(rows: Sequence[Any], queue: str, channel: str) -> tuple[Any, ...]:
    # outbox_take's rows, by column name, as insert_messages takes them.
    return insert_args(rows[0]["from_endpoint"], queue, outbox_arrays(rows), channel)
