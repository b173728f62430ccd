"""The PostgreSQL adapter of the storage port, on asyncpg.

Connections a process uses: ``send_pool_size`` pooled ones for send/publish
and schema work, one per worker loop, one for LISTEN and one for lease renewal.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import asyncpg
import structlog
from asyncpg.transaction import Transaction

from nmbus.errors import QueueNotFound, SchemaVersionError
from nmbus.logs import log_failure, scrub
from nmbus.messages import Envelope, StoredMessage
from nmbus.postgres.errors import is_connection_error, wrap_connect_errors, wrap_errors
from nmbus.postgres.pubsub import (
    create_queue_on,
    install_publish_function,
    publish_args,
    publish_on,
)
from nmbus.postgres.sagas import PostgresSagaTable, create_saga_table
from nmbus.postgres.sql import QUERIES, render
from nmbus.settings import Settings
from nmbus.store import SCHEMA_VERSION, Outcomes, validate_queue_name, validate_schema_name

log = structlog.get_logger("nmbus.postgres")

# Schema changes after version 1, by the version they bring the schema to: names
# of the blocks in sql/migrations/, run once per schema, or once per queue table
# when the block names {queue}.
MIGRATIONS: dict[int, list[str]] = {
    2: ["migrate_2_fillfactor"],
    3: ["migrate_3_names", "migrate_3_queue"],
    4: ["migrate_4_isolated"],
    5: ["migrate_5_delivery"],
    6: ["migrate_6_routes"],
    7: ["migrate_7_done"],
    8: ["migrate_8_saga_instance"],
    9: ["migrate_9_periodic_due"],
}


def notify_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel on which inserts into ``schema``'s queues are announced."""
    return f"nmbus_{schema}"


def outbox_channel(schema: str) -> str:
    """The channel on which rows written into ``schema``'s outbox are announced."""
    return f"nmbus_outbox_{schema}"


def _insert_args(
    from_endpoint: str, queue: str, envelopes: Sequence[Envelope], channel: str
) -> tuple[Any, ...]:
    return (
        from_endpoint,
        queue,
        [e.deliver_at for e in envelopes],
        [e.correlation_id for e in envelopes],
        [e.label for e in envelopes],
        [e.msg_text for e in envelopes],
        [e.msg_headers for e in envelopes],
        [e.unique_id for e in envelopes],
        channel,
        [e.priority for e in envelopes],
        [e.sequence for e in envelopes],
        [e.expires_at for e in envelopes],
    )


def _stored(row: asyncpg.Record) -> StoredMessage:
    return StoredMessage(*row)


def _claim_order(message: StoredMessage) -> tuple[int, Any, int]:
    return (-message.priority, message.retry_time, message.id)


async def install_schema(conn: Any, schema: str) -> None:
    """Create or migrate ``schema`` to SCHEMA_VERSION, holding an advisory lock."""
    validate_schema_name(schema)
    async with conn.transaction():
        await conn.execute(render("advisory_lock", schema), f"nmbus.schema.{schema}")
        exists = await conn.fetchval(render("schema_exists", schema), schema)
        version = await conn.fetchval(render("schema_version", schema)) if exists else None
        if version is not None and version > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"schema {schema!r} is at version {version}, newer than this nmbus "
                f"understands ({SCHEMA_VERSION}); upgrade nmbus"
            )
        if version is None:
            await conn.execute(render("create_schema", schema))
            await conn.execute(render("set_schema_version", schema), SCHEMA_VERSION)
            return
        for target in range(version + 1, SCHEMA_VERSION + 1):
            queues = [r[0] for r in await conn.fetch(render("list_queues", schema), schema)]
            for name in MIGRATIONS.get(target, []):
                if "{queue}" in QUERIES[name]:
                    for queue in queues:
                        await conn.execute(render(name, schema, queue))
                else:
                    await conn.execute(render(name, schema))
            await conn.execute(render("set_schema_version", schema), target)
            log.info("schema_migrated", schema=schema, version=target)


async def insert_outbox(
    conn: Any, schema: str, queue: str, from_endpoint: str, envelopes: Sequence[Envelope]
) -> int:
    """Write messages for ``queue`` (in another database) into the outbox, on ``conn``.

    One statement: atomic on its own, or part of the caller's transaction.
    """
    args = _insert_args(from_endpoint, queue, envelopes, outbox_channel(schema))
    with wrap_errors(f"send to {queue} (through the outbox)"):
        row = await conn.fetchrow(render("outbox_insert", schema), *args)
    return int(row[0]) if row else 0


#: The comment of a queue table that a send created (docs/operations.md).
CREATED_BY_SEND = "nmbus: created by a send; no endpoint has started on it"


async def ensure_queue_on(
    conn: Any,
    schema: str,
    queue: str,
    known: set[str],
    sender: str | None = None,
    create: bool = True,
) -> None:
    """Make sure ``queue`` has a table, creating it in the transaction of ``conn``.

    ``known`` holds queues whose table is committed; one created here is not
    added, since the transaction that created it may still roll back. For a
    send (``sender`` is the sending endpoint) a table no endpoint created is
    refused with QueueNotFound unless ``create``; created, it is marked and
    logged (``queue_created_by_send``) once.
    """
    if queue in known:
        return
    validate_queue_name(queue)
    with wrap_errors(f"create queue {queue}"):
        exists = await conn.fetchval(render("queue_exists", schema), schema, queue)
    if exists:
        known.add(queue)
        return
    if sender is not None and not create:
        raise QueueNotFound(no_such_queue(queue))
    await create_queue_on(conn, schema, queue)
    if sender is not None:
        with wrap_errors(f"create queue {queue}"):
            await conn.execute(render("mark_created_by_send", schema, queue))
        log.warning("queue_created_by_send", queue=queue, sender=sender, schema=schema)


def no_such_queue(queue: str) -> str:
    return (
        f"no queue {queue!r}: no endpoint has started on it in this database (a typo?). "
        f"Start its endpoint first, create it with 'nmbus queues create {queue}', or let "
        "sends create queues (create_queues=True, NMBUS_CREATE_QUEUES=true)"
    )


async def database_identity(conn: Any) -> tuple[Any, ...]:
    """What tells the database of ``conn`` apart from any other, on any server."""
    row = await conn.fetchrow(render("database_identity", "nmbus"))
    return tuple(row)


class PostgresBatch:
    """One batch on a worker's connection; its transaction begins when first needed.

    A batch whose handlers never touch the connection nor send anything needs
    no transaction: its ``finish`` is one autocommitted statement, which saves
    the BEGIN and COMMIT round trips. The first write (a handler's savepoint,
    an insert) begins the transaction, and ``finish`` then runs inside it.
    """

    def __init__(
        self,
        conn: asyncpg.Connection,
        schema: str,
        known: set[str],
        routed: frozenset[str] = frozenset(),
    ) -> None:
        self._conn = conn
        self._schema = schema
        self._known = known
        self._routed = routed
        self._channel = notify_channel(schema)
        # asyncpg's own Transaction, so a handler may still nest conn.transaction().
        self.transaction: Transaction | None = None
        self._unreleased = False

    @property
    def begun(self) -> bool:
        return self.transaction is not None

    @property
    def connection(self) -> asyncpg.Connection:
        return self._conn

    async def begin(self) -> None:
        """Begin the batch's transaction if it has not begun (no savepoint)."""
        if self.transaction is None:
            transaction = self._conn.transaction()
            await transaction.start()
            self.transaction = transaction

    async def savepoint(self) -> None:
        if self._unreleased:
            # The previous handler's savepoint goes in the same round trip.
            self._unreleased = False
            await self._conn.execute("RELEASE SAVEPOINT nmbus_handler; SAVEPOINT nmbus_handler")
            return
        await self.begin()
        await self._conn.execute("SAVEPOINT nmbus_handler")

    async def release_savepoint(self) -> None:
        await self._conn.execute("RELEASE SAVEPOINT nmbus_handler")

    def defer_release(self) -> None:
        """Leave a succeeded handler's savepoint to the next savepoint or the COMMIT.

        Only for a savepoint whose statements all succeeded: one that may be
        aborted must be released at once, so its handler is the one that fails.
        """
        self._unreleased = True

    async def rollback_savepoint(self) -> None:
        self._unreleased = False
        await self._conn.execute(
            "ROLLBACK TO SAVEPOINT nmbus_handler; RELEASE SAVEPOINT nmbus_handler"
        )

    async def commit(self) -> None:
        """Commit the transaction so far; the next write begins another one."""
        transaction, self.transaction = self.transaction, None
        self._unreleased = False  # COMMIT releases every savepoint
        if transaction is not None:
            await transaction.commit()

    async def insert(self, queue: str, from_endpoint: str, envelopes: Sequence[Envelope]) -> int:
        await self.begin()
        if queue in self._routed:
            return await insert_outbox(self._conn, self._schema, queue, from_endpoint, envelopes)
        # A handler's send is stored at its batch's commit, where a refusal would
        # fail the batch-mates too: a missing queue is created (marked, logged).
        await ensure_queue_on(self._conn, self._schema, queue, self._known, from_endpoint)
        sql = render("insert_messages", self._schema, queue)
        row = await self._conn.fetchrow(
            sql, *_insert_args(from_endpoint, queue, envelopes, self._channel)
        )
        return int(row[0]) if row else 0

    async def subscribers(self, publisher: str, types: Sequence[str]) -> list[str]:
        rows = await self._conn.fetch(render("subscribers", self._schema), publisher, list(types))
        return [r[0] for r in rows]

    async def publish(
        self, publisher: str, envelopes: Sequence[Envelope], chains: Sequence[str]
    ) -> dict[str, int]:
        await self.begin()  # the copies commit with the batch, never before it
        args = publish_args(self._schema, publisher, envelopes, chains, self._channel, self._routed)
        return await publish_on(self._conn, self._schema, args)

    async def finish(self, queue: str, outcomes: Outcomes, client_id: str) -> int:
        return int(
            await self._conn.fetchval(
                render("finish", self._schema, queue),
                outcomes.ids,
                outcomes.subqueue,
                outcomes.delay,
                outcomes.error_info,
                outcomes.correction,
                client_id,
            )
        )

    async def finish_and_claim(
        self, queue: str, outcomes: Outcomes, client_id: str, limit: int, lease: float
    ) -> tuple[int, list[StoredMessage]]:
        """``finish``, then claim up to ``limit`` more rows, in one statement."""
        if outcomes.all_processed:
            # The common case needs no per-row outcome arrays on the wire or in a join.
            rows = await self._conn.fetch(
                render("finish_claim_processed", self._schema, queue),
                outcomes.ids,
                client_id,
                limit,
                lease,
            )
        else:
            rows = await self._conn.fetch(
                render("finish_claim", self._schema, queue),
                outcomes.ids,
                outcomes.subqueue,
                outcomes.delay,
                outcomes.error_info,
                outcomes.correction,
                client_id,
                limit,
                lease,
            )
        finished = int(rows[0][13]) if rows else 0
        claimed = [StoredMessage(*r[:13]) for r in rows if r[0] is not None]
        claimed.sort(key=_claim_order)
        return finished, claimed


class PostgresSession:
    """A worker loop's dedicated connection."""

    def __init__(
        self,
        conn: asyncpg.Connection,
        schema: str,
        known: set[str],
        routed: frozenset[str] = frozenset(),
    ) -> None:
        self._conn = conn
        self._schema = schema
        self._known = known
        self._routed = routed

    async def claim(
        self, queue: str, limit: int, client_id: str, lease: float
    ) -> list[StoredMessage]:
        with wrap_errors(f"claim from {queue}"):
            rows = await self._conn.fetch(
                render("claim", self._schema, queue), limit, client_id, lease
            )
        messages = [_stored(r) for r in rows]
        messages.sort(key=_claim_order)
        return messages

    async def next_due(self, queue: str) -> float | None:
        with wrap_errors(f"next due in {queue}"):
            value: float | None = await self._conn.fetchval(render("next_due", self._schema, queue))
            return value

    async def release_sequences(self, queue: str) -> int:
        with wrap_errors(f"release sequences of {queue}"):
            return int(await self._conn.fetchval(render("release_sequences", self._schema, queue)))

    async def isolate(
        self,
        queue: str,
        ids: Sequence[int],
        suspect: int,
        marks: Sequence[bool],
        client_id: str,
        refunds: Sequence[int],
    ) -> int:
        with wrap_errors(f"isolate a message of {queue}"):
            changed = await self._conn.fetchval(
                render("isolate", self._schema, queue),
                list(ids),
                suspect,
                client_id,
                list(marks),
                list(refunds),
            )
        return int(changed)

    @asynccontextmanager
    async def batch(self) -> AsyncIterator[PostgresBatch]:
        with wrap_errors("batch transaction"):
            batch = PostgresBatch(self._conn, self._schema, self._known, self._routed)
            try:
                yield batch
            except BaseException:
                if batch.transaction is not None and not self._conn.is_closed():
                    await asyncio.shield(batch.transaction.rollback())
                raise
            if batch.transaction is not None:
                await batch.transaction.commit()


class PostgresStore:
    """Queue tables and subscriptions in one PostgreSQL schema.

    Queues named in ``routed`` live in other databases: what is sent or published
    to them is written into this schema's outbox, for the forwarder to move.
    """

    def __init__(
        self,
        dsn: str | None,
        schema: str = "nmbus",
        pool_size: int = 4,
        routed: Collection[str] = (),
        create_queues: bool = True,
    ) -> None:
        self.dsn = dsn
        # Whether a send may create the table of a queue no endpoint created.
        self.create_queues = create_queues
        self.schema = validate_schema_name(schema)
        self.routed = frozenset(validate_queue_name(q) for q in routed)
        self._pool_size = pool_size
        self._pool: asyncpg.Pool | None = None
        self._known_queues: set[str] = set()
        self._queue_lock = asyncio.Lock()
        self._lease_lock = asyncio.Lock()
        self._lease_conn: asyncpg.Connection | None = None

    def __repr__(self) -> str:
        dsn = scrub(self.dsn) if self.dsn else None
        return f"<PostgresStore schema={self.schema!r} dsn={dsn!r}>"

    async def connect(self) -> asyncpg.Connection:
        with wrap_errors("connect"):
            conn: asyncpg.Connection = await asyncpg.connect(self.dsn, timeout=10)
            return conn

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("the store is not open; use 'async with bus:' first")
        return self._pool

    async def open(self) -> None:
        with wrap_errors("open"):
            # A DSN that cannot work is an InvalidSetting, as the operations layer says
            # it; a server that cannot be reached stays "database unavailable".
            with wrap_connect_errors(self.dsn, unavailable=False):
                self._pool = await asyncpg.create_pool(
                    self.dsn, min_size=1, max_size=self._pool_size, timeout=10
                )
            async with self._pool.acquire() as conn:
                await install_schema(conn, self.schema)
                await install_publish_function(conn, self.schema)

    async def close(self) -> None:
        if self._lease_conn is not None:
            conn, self._lease_conn = self._lease_conn, None
            await _close_quietly(conn)
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await asyncio.shield(pool.close())

    async def ensure_queue(self, queue: str) -> None:
        """Create ``queue``'s table if missing: its endpoint starts, or an operator asks.

        Either way it is a queue someone meant: a table a send created is unmarked.
        """
        await self._ensure(queue, None)

    async def _ensure(self, queue: str, sender: str | None) -> None:
        """``ensure_queue``, or for a send from ``sender``: refused unless create_queues."""
        if queue in self._known_queues:
            return
        validate_queue_name(queue)
        if queue in self.routed:
            return  # its table is in its own database
        async with self._queue_lock:
            if queue in self._known_queues:
                return
            with wrap_errors(f"create queue {queue}"):
                async with self.pool.acquire() as conn:
                    row = await conn.fetchrow(
                        render("queue_comment", self.schema), self.schema, queue
                    )
                    if row is None and sender is not None and not self.create_queues:
                        raise QueueNotFound(no_such_queue(queue))
                    if row is None:
                        async with conn.transaction():
                            await create_queue_on(conn, self.schema, queue)
                            if sender is not None:
                                await conn.execute(
                                    render("mark_created_by_send", self.schema, queue)
                                )
                        if sender is not None:
                            log.warning(
                                "queue_created_by_send",
                                queue=queue,
                                sender=sender,
                                schema=self.schema,
                            )
                    elif sender is None and row[0] == CREATED_BY_SEND:
                        await conn.execute(render("unmark_queue", self.schema, queue))
            self._known_queues.add(queue)

    async def routes_to_itself(self, routes: Mapping[str, str], timeout: float = 5.0) -> list[str]:
        """The queues of ``routes`` (queue -> DSN) whose DSN reaches this store's own database.

        However the DSN is spelt (another host name, scheme or user), the
        database that answers is compared with this one. A DSN that does not
        answer within ``timeout`` is not this database, which does.
        """
        with wrap_errors("look at routes"):
            async with self.pool.acquire() as conn:
                own = await database_identity(conn)

        async def same(dsn: str) -> bool:
            if dsn == self.dsn:
                return True
            try:
                conn = await asyncpg.connect(dsn, timeout=timeout)
            except Exception:
                return False  # down, or refusing: never this database, which answered
            try:
                return await database_identity(conn) == own
            except Exception:
                return False
            finally:
                await _close_quietly(conn)

        dsns = sorted(set(routes.values()))
        answers = dict(zip(dsns, await asyncio.gather(*(same(d) for d in dsns)), strict=True))
        return sorted(queue for queue, dsn in routes.items() if answers[dsn])

    async def ensure_sagas(self, endpoint: str) -> None:
        await create_saga_table(self.pool, self.schema, endpoint)

    def saga_table(self, endpoint: str) -> PostgresSagaTable:
        # The pool is looked up at each load: the table object outlives a restart.
        return PostgresSagaTable(lambda: self.pool, self.schema, validate_queue_name(endpoint))

    async def drop_queue(self, queue: str) -> None:
        validate_queue_name(queue)
        with wrap_errors(f"drop queue {queue}"):
            async with self.pool.acquire() as conn, conn.transaction():
                await conn.execute(render("drop_queue", self.schema, queue))
                await conn.execute(render("forget_queue", self.schema), queue)
        self._known_queues.discard(queue)

    async def list_queues(self) -> list[str]:
        with wrap_errors("list queues"):
            rows = await self.pool.fetch(render("list_queues", self.schema), self.schema)
        return [r[0] for r in rows]

    async def insert(
        self,
        queue: str,
        from_endpoint: str,
        envelopes: Sequence[Envelope],
        connection: Any = None,
    ) -> int:
        if queue in self.routed:
            return await self._insert_routed(queue, from_endpoint, envelopes, connection)
        sql = render("insert_messages", self.schema, queue)
        args = _insert_args(from_endpoint, queue, envelopes, notify_channel(self.schema))
        if connection is None:
            await self._ensure(queue, from_endpoint)
            with wrap_errors(f"send to {queue}"):
                row = await self.pool.fetchrow(sql, *args)
            return int(row[0]) if row else 0
        # The caller's connection may be the pool's last one: never wait for another.
        # A missing table is created in the caller's transaction, and goes if it rolls back.
        with wrap_errors(f"send to {queue}"):
            own = None if connection.is_in_transaction() else connection.transaction()
            async with own or contextlib.nullcontext():
                await ensure_queue_on(
                    connection,
                    self.schema,
                    queue,
                    self._known_queues,
                    from_endpoint,
                    self.create_queues,
                )
                row = await connection.fetchrow(sql, *args)
        return int(row[0]) if row else 0

    async def insert_tick(
        self, queue: str, schedule: str, due: datetime, envelope: Envelope
    ) -> bool:
        await self.ensure_queue(queue)
        with wrap_errors(f"enqueue tick {schedule} of {queue}"):
            inserted = await self.pool.fetchval(
                render("insert_tick", self.schema, queue),
                queue,
                envelope.correlation_id,
                envelope.label,
                envelope.msg_text,
                envelope.msg_headers,
                envelope.unique_id,
                notify_channel(self.schema),
                schedule,
                due,
            )
        return bool(inserted)

    async def _insert_routed(
        self, queue: str, from_endpoint: str, envelopes: Sequence[Envelope], connection: Any
    ) -> int:
        if connection is None:
            async with self.pool.acquire() as conn:
                return await insert_outbox(conn, self.schema, queue, from_endpoint, envelopes)
        return await insert_outbox(connection, self.schema, queue, from_endpoint, envelopes)

    async def subscribe(
        self,
        publisher: str,
        subscriber: str,
        types: Sequence[str],
        ttl: float | None,
        remote: bool = False,
    ) -> None:
        with wrap_errors("subscribe"):
            await self.pool.execute(
                render("subscribe", self.schema), publisher, subscriber, list(types), ttl, remote
            )

    async def unsubscribe(self, publisher: str, subscriber: str, types: Sequence[str]) -> None:
        with wrap_errors("unsubscribe"):
            await self.pool.execute(
                render("unsubscribe", self.schema), publisher, subscriber, list(types)
            )

    async def subscribers(
        self, publisher: str, types: Sequence[str], connection: Any = None
    ) -> list[str]:
        target = connection if connection is not None else self.pool
        with wrap_errors("find subscribers"):
            rows = await target.fetch(render("subscribers", self.schema), publisher, list(types))
        return [r[0] for r in rows]

    async def publish(
        self,
        publisher: str,
        envelopes: Sequence[Envelope],
        chains: Sequence[str],
        connection: Any = None,
    ) -> dict[str, int]:
        args = publish_args(
            self.schema, publisher, envelopes, chains, notify_channel(self.schema), self.routed
        )
        if connection is not None:
            if connection.is_in_transaction():
                return await publish_on(connection, self.schema, args)
            async with connection.transaction():
                return await publish_on(connection, self.schema, args)
        # One statement is atomic on its own: no BEGIN/COMMIT round trips, unless
        # a subscriber's table has to be created first.
        with wrap_errors("publish"):
            rows = await self.pool.fetch(render("publish", self.schema), *args)
        if not any(r[2] for r in rows):
            return {r[0]: int(r[1]) for r in rows}
        with wrap_errors("publish"):
            async with self.pool.acquire() as conn, conn.transaction():
                return await publish_on(conn, self.schema, args)

    async def purge_expired_subscriptions(self, grace: float) -> int:
        with wrap_errors("purge expired subscriptions"):
            status = await self.pool.execute(
                render("purge_expired_subscriptions", self.schema), grace
            )
        return int(status.split()[-1])

    async def has_ready(self, queue: str) -> bool:
        with wrap_errors(f"look at {queue}"):
            return bool(await self.pool.fetchval(render("has_ready", self.schema, queue)))

    async def apply_retention(self, queue: str, settings: Settings) -> None:
        from nmbus.retention import RetentionPolicy, clean_queue

        policy = RetentionPolicy.from_settings(settings)
        async with self.pool.acquire() as conn:
            await clean_queue(conn, self.schema, queue, policy)

    async def counts(self, queue: str) -> dict[str, int]:
        with wrap_errors(f"count {queue}"):
            rows = await self.pool.fetch(render("subqueue_counts", self.schema, queue))
        found = {r[0]: int(r[1]) for r in rows}
        return {sq: found.get(sq, 0) for sq in "IRXF"}

    async def renew_leases(
        self, queue: str, ids: Sequence[int], client_id: str, lease: float
    ) -> None:
        # On a connection of its own, never the send pool: an application that
        # holds every pooled connection (long outbox transactions, a burst of
        # sends) must not make the leases of running handlers expire.
        async with self._lease_lock:
            with wrap_errors(f"renew leases in {queue}"):
                if self._lease_conn is None or self._lease_conn.is_closed():
                    self._lease_conn = await asyncpg.connect(self.dsn, timeout=10)
                try:
                    await self._lease_conn.execute(
                        render("renew_leases", self.schema, queue),
                        list(ids),
                        client_id,
                        lease,
                        timeout=max(1.0, lease / 3),
                    )
                except BaseException:
                    conn, self._lease_conn = self._lease_conn, None
                    conn.terminate()
                    raise

    async def abandon_leases(
        self, queue: str, ids: Sequence[int], client_id: str, refund: bool = False
    ) -> None:
        with wrap_errors(f"abandon leases in {queue}"):
            await self.pool.execute(
                render("abandon_leases", self.schema, queue), list(ids), client_id, int(refund)
            )

    @asynccontextmanager
    async def worker_session(self) -> AsyncIterator[PostgresSession]:
        conn = await self.connect()
        try:
            yield PostgresSession(conn, self.schema, self._known_queues, self.routed)
        finally:
            await _close_quietly(conn)

    async def listen(self, on_wakeup: Callable[[str], None], reconnect_max: float = 10.0) -> None:
        channel = notify_channel(self.schema)
        delay = 0.1

        def callback(_conn: object, _pid: int, _channel: str, payload: object) -> None:
            on_wakeup(str(payload))

        while True:
            conn: asyncpg.Connection | None = None
            try:
                conn = await self.connect()
                lost = asyncio.Event()
                conn.add_termination_listener(lambda _c, lost=lost: lost.set())
                await conn.add_listener(channel, callback)
                log.debug("listener_connected", channel=channel)
                delay = 0.1
                # Anything inserted while we were away must be looked at now.
                on_wakeup("*")
                while not lost.is_set():
                    try:
                        await asyncio.wait_for(lost.wait(), timeout=5.0)
                    except TimeoutError:
                        # A cheap round trip notices a dead server sooner than TCP does.
                        await conn.fetchval("SELECT 1", timeout=5.0)
                log.warning("listener_connection_lost", channel=channel)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not is_connection_error(exc) and not isinstance(exc.__cause__, BaseException):
                    log_failure(log, "listener_failed", exc, channel=channel)
                else:
                    log.warning("listener_connection_lost", channel=channel, error=str(exc))
            finally:
                if conn is not None:
                    await _close_quietly(conn)
            await asyncio.sleep(delay)
            delay = min(reconnect_max, delay * 2)


async def _close_quietly(conn: asyncpg.Connection) -> None:
    try:
        await asyncio.shield(asyncio.wait_for(conn.close(), timeout=2))
    except Exception:
        conn.terminate()
