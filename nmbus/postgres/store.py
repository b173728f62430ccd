"""The PostgreSQL adapter of the storage port, on asyncpg.

Connections a store uses: up to ``send_pool_size`` in the send pool and one
LISTEN, both shared with the process's other stores on the same DSN, one per
worker loop and one for lease renewal (:mod:`nmbus.postgres.connections`).
The schema and its channels are :mod:`nmbus.postgres.schema`; a worker loop's
connection and its batches, :mod:`nmbus.postgres.session`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import asyncpg
import structlog

from nmbus.delivery.cancellation import Cancel
from nmbus.delivery.flow import FlowLimits, LimitStatus
from nmbus.errors import QueueNotFound
from nmbus.logs import scrub
from nmbus.messages import Envelope
from nmbus.names import validate_queue_name, validate_schema_name
from nmbus.ports.operations import RetentionPolicy
from nmbus.ports.store import Readiness
from nmbus.postgres.cancel import cancel_on
from nmbus.postgres.claimcheck import (
    ClaimCheck,
    forget_queue,
    has_apart,
    insert_apart,
    refuse_apart,
    remove_files,
)
from nmbus.postgres.connections import SharedPool, listen_shared, open_pool, server_settings
from nmbus.postgres.errors import wrap_connect_errors, wrap_errors
from nmbus.postgres.floor import ReadyFloors
from nmbus.postgres.flow import flow_status_on
from nmbus.postgres.listen import close_quietly as _close_quietly
from nmbus.postgres.listen import notify_channel
from nmbus.postgres.pooler import Pooler, refuse_deaf_listener
from nmbus.postgres.primary import refuse_read_only
from nmbus.postgres.pubsub import (
    create_queue_on,
    install_publish_function,
    publish_args,
    publish_on,
)
from nmbus.postgres.retention import clean_queue
from nmbus.postgres.rows import envelope_arrays, insert_args, insert_sql
from nmbus.postgres.sagas import PostgresSagaTable, create_saga_table
from nmbus.postgres.schema import (
    CREATED_BY_SEND,
    database_identity,
    ensure_queue_on,
    install_schema,
    no_such_queue,
    readiness_on,
)
from nmbus.postgres.session import PostgresSession, idle_lift, insert_outbox
from nmbus.postgres.sql import render
from nmbus.settings import Settings

# The forwarder imports these from here, where they were first written.
__all__ = ["PostgresStore", "ensure_queue_on", "install_schema"]

log = structlog.get_logger("nmbus.postgres")


#: Worker connections plan their prepared statements once, generically. Over a
#: queue's segments a custom plan of the finish-and-claim costs about 5 ms to make
#: (for 2 ms of work), and PostgreSQL's plan cache keeps choosing it, since the
#: generic plan's estimate cannot know the batch size. The generic plans of
#: nmbus's statements stay on the indexes (tests/test_segments_storage.py).
WORKER_SERVER_SETTINGS = {"plan_cache_mode": "force_generic_plan"}


class PostgresStore:
    """Queue tables and subscriptions in one PostgreSQL schema.

    Queues named in ``routed`` live in other databases: what is sent or published
    to them is written into this schema's outbox, for the forwarder to move.
    ``endpoint``, the one whose store it is, names its own connections
    (``nmbus:<endpoint>:loop`` and ``:lease`` in ``pg_stat_activity``).
    """

    def __init__(
        self,
        dsn: str | None,
        schema: str = "nmbus",
        pool_size: int = 4,
        routed: Collection[str] = (),
        create_queues: bool = True,
        pooler: Pooler | None = None,
        endpoint: str | None = None,
        claim_check: ClaimCheck | None = None,
    ) -> None:
        self.dsn = dsn
        # Where bodies over claim_check_bytes go (nmbus/postgres/claimcheck.py).
        self.claim_check = claim_check or ClaimCheck()
        # Straight to PostgreSQL, or through a transaction pooler (nmbus/postgres/pooler.py).
        self.pooler = pooler or Pooler()
        self.endpoint = validate_queue_name(endpoint) if endpoint is not None else None
        # Whether a send may create the table of a queue no endpoint created.
        self.create_queues = create_queues
        self.schema = validate_schema_name(schema)
        self.routed = frozenset(validate_queue_name(q) for q in routed)
        self._pool_size = pool_size
        # The process's send pool on this DSN, shared with its other stores.
        self._pool: SharedPool | None = None
        self._known_queues: set[str] = set()
        # Each queue's ready floor, shared by this store's worker loops.
        self._floors = ReadyFloors(self.schema, connection=lambda: self.pool.acquire())
        self._queue_lock = asyncio.Lock()
        self._lease_lock = asyncio.Lock()
        self._lease_conn: asyncpg.Connection | None = None

    def __repr__(self) -> str:
        dsn = scrub(self.dsn) if self.dsn else None
        return f"<PostgresStore schema={self.schema!r} dsn={dsn!r}>"

    async def connect(self) -> asyncpg.Connection:
        """A worker's connection (docs/storage.md, "Plans over segments")."""
        with wrap_errors("connect"):
            conn: asyncpg.Connection = await asyncpg.connect(
                self.dsn,
                timeout=10,
                server_settings=server_settings(self.dsn, "loop", self.endpoint),
                **self.pooler.connect_options(),
            )
            try:
                await self.pooler.configure(conn, WORKER_SERVER_SETTINGS)
            except BaseException:
                conn.terminate()
                raise
            return conn

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None or self._pool.pool is None:
            raise RuntimeError("the store is not open; use 'async with bus:' first")
        return self._pool.pool

    async def open(self) -> None:
        with wrap_errors("open"):
            # A DSN that cannot work is an InvalidSetting, as the operations layer says
            # it; a server that cannot be reached stays "database unavailable".
            if self._pool is not None:
                raise RuntimeError("the store is open already")
            with wrap_connect_errors(self.dsn, unavailable=False):
                self._pool = await open_pool(self.dsn, self._pool_size, self.pooler)
            # Before anything is prepared: refused here, not at the first send.
            await self._refuse_unusable(self.pool)
            async with self.pool.acquire() as conn:
                await install_schema(conn, self.schema)
                await install_publish_function(conn, self.schema)

    async def _refuse_unusable(self, pool: asyncpg.Pool) -> None:
        """A read-only server, then a listener that would not hear (a standby fails
        the latter's LISTEN: it must be told to go to the primary first)."""
        try:
            async with pool.acquire() as conn:
                await refuse_read_only(conn, self.dsn)
                await refuse_deaf_listener(self.pooler, self.dsn, conn)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        if self._lease_conn is not None:
            conn, self._lease_conn = self._lease_conn, None
            await _close_quietly(conn)
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()

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
                conn = await asyncpg.connect(dsn, timeout=timeout, **self.pooler.connect_options())
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
                files = await forget_queue(conn, self.schema, queue)
        self._known_queues.discard(queue)
        if files:
            await remove_files(files)

    async def list_queues(self) -> list[str]:
        with wrap_errors("list queues"):
            rows = await self.pool.fetch(render("list_queues", self.schema), self.schema)
        return [r[0] for r in rows]

    async def readiness(self, queue: str) -> Readiness:
        with wrap_errors("check readiness"):
            async with self.pool.acquire() as conn:
                return await readiness_on(conn, self.schema, queue)

    async def insert(
        self,
        queue: str,
        from_endpoint: str,
        envelopes: Sequence[Envelope],
        connection: Any = None,
    ) -> int:
        if queue in self.routed:
            refuse_apart(queue, envelopes, "the outbox of a route")
            return await self._insert_routed(queue, from_endpoint, envelopes, connection)
        channel = notify_channel(self.schema)
        write: Callable[[Any], Awaitable[int]]
        if has_apart(envelopes):
            # The claim check: bodies over claim_check_bytes stored apart, in the
            # same statement (nmbus/postgres/claimcheck.py).
            def write(target: Any) -> Awaitable[int]:
                return insert_apart(
                    target, self.claim_check, self.schema, queue, from_endpoint, envelopes, channel
                )

        else:
            sql = insert_sql(self.schema, queue, len(envelopes))
            args = insert_args(from_endpoint, queue, envelope_arrays(envelopes), channel)

            async def write(target: Any) -> int:
                row = await target.fetchrow(sql, *args)
                return int(row[0]) if row else 0

        if connection is None:
            await self._ensure(queue, from_endpoint)
            with wrap_errors(f"send to {queue}"):
                return await write(self.pool)
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
                return await write(connection)

    async def insert_tick(
        self, queue: str, schedule: str, due: datetime, envelope: Envelope
    ) -> bool:
        refuse_apart(queue, [envelope], "a periodic schedule's tick")
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
        policy = RetentionPolicy.from_settings(settings)
        with wrap_errors(f"retention of {queue}"):
            async with self.pooler.lock_holder(self.dsn) as holder, self.pool.acquire() as conn:
                await clean_queue(conn, self.schema, queue, policy, holder=holder)

    async def declare_limits(
        self, queue: str, flow: FlowLimits, client_id: str
    ) -> list[tuple[str, str, str, datetime]]:
        described = flow.described()
        keys, concurrency, starts, windows, group_concurrency = flow.arrays()
        with wrap_errors(f"declare the limits of {queue}"):
            rows = await self.pool.fetch(
                render("flow_declare", self.schema),
                queue,
                keys,
                [described[key] for key in keys],
                client_id,
                ["\n".join(flow.labels[key]) for key in keys],
                concurrency,
                starts,
                windows,
                group_concurrency,
            )
        return [(r[0], r[1], r[2], r[3]) for r in rows]

    async def flow_started(self, queue: str, starts: Sequence[tuple[str, int, int, str]]) -> None:
        keys, ids, attempts, claims = (list(column) for column in zip(*starts, strict=True))
        with wrap_errors(f"mark starts in {queue}"):
            await self.pool.execute(
                render("flow_started", self.schema), queue, keys, ids, attempts, claims
            )

    async def flow_status(self, queues: Sequence[str] | None) -> list[LimitStatus]:
        async with self.pool.acquire() as conn:
            with wrap_errors("read the flow limits"):
                return await flow_status_on(conn, self.schema, queues)

    async def cancel(self, queue: str, request: Cancel) -> int:
        async with self.pool.acquire() as conn:
            with wrap_errors(f"cancel in {queue}"):
                return await cancel_on(conn, self.schema, queue, request)

    async def counts(self, queue: str) -> dict[str, int]:
        with wrap_errors(f"count {queue}"):
            rows = await self.pool.fetch(render("subqueue_counts", self.schema, queue))
        found = {r[0]: int(r[1]) for r in rows}
        return {sq: found.get(sq, 0) for sq in "IRXF"}

    async def renew_leases(
        self, queue: str, ids: Sequence[int], claims: Sequence[str], lease: float
    ) -> set[int]:
        sql = render("renew_leases", self.schema, queue)
        args = (list(ids), list(claims), lease)
        rows = await self._on_lease_conn(
            f"renew leases in {queue}", max(1.0, lease / 3), sql, *args
        )
        return {int(row[0]) for row in rows}

    async def give_back(
        self, queue: str, ids: Sequence[int], attempts: Sequence[int], claim: str
    ) -> list[int]:
        sql = render("give_back", self.schema, queue)
        args = (list(ids), list(attempts), claim)
        rows = await self._on_lease_conn(f"give back a batch of {queue}", 5.0, sql, *args)
        return [int(row[0]) for row in rows]

    async def _on_lease_conn(
        self, doing: str, timeout: float, sql: str, *args: object
    ) -> list[asyncpg.Record]:
        """``sql`` on the leases' connection of its own, never the send pool: an
        application that holds every pooled connection (long outbox transactions, a
        burst of sends) must not make the leases of running handlers expire, nor
        keep a worker loop from giving back a batch it will not run."""
        async with self._lease_lock:
            with wrap_errors(doing):
                if self._lease_conn is None or self._lease_conn.is_closed():
                    self._lease_conn = await asyncpg.connect(
                        self.dsn,
                        timeout=10,
                        server_settings=server_settings(self.dsn, "lease", self.endpoint),
                        **self.pooler.connect_options(),
                    )
                try:
                    rows: list[asyncpg.Record] = await self._lease_conn.fetch(
                        sql, *args, timeout=timeout
                    )
                    return rows
                except BaseException:
                    conn, self._lease_conn = self._lease_conn, None
                    conn.terminate()
                    raise

    async def abandon_leases(
        self,
        queue: str,
        ids: Sequence[int],
        claim: str,
        refund: bool = False,
        suspects: Collection[int] = (),
    ) -> None:
        sql = render("abandon_leases", self.schema, queue)
        args = (list(ids), claim, int(refund), [i for i in ids if i in suspects])
        await self._on_lease_conn(f"abandon leases in {queue}", 5.0, sql, *args)

    @asynccontextmanager
    async def worker_session(
        self, flow: FlowLimits | None = None, idle: float | None = None
    ) -> AsyncIterator[PostgresSession]:
        conn = await self.connect()
        try:
            lift = await idle_lift(conn, self.schema, idle)
            yield PostgresSession(
                conn,
                self.schema,
                self._known_queues,
                self.routed,
                self._floors,
                flow,
                lift,
                self.claim_check,
            )
        finally:
            await _close_quietly(conn)

    async def listen(self, on_wakeup: Callable[[str], None], reconnect_max: float = 10.0) -> None:
        """LISTEN on the DSN, or on ``listen_dsn`` behind a transaction pooler, through
        the process's one listener there (shared by its stores); behind a pooler
        without it, return at once: the worker's loops look every poll_interval."""
        if not self.pooler.listens:
            log.info("listener_off", schema=self.schema, reason="pooler=transaction, no listen_dsn")
            return
        dsn = self.pooler.listen_on(self.dsn)

        async def connect() -> asyncpg.Connection:
            # Never through a transaction pooler (listen_on): a connection of its own.
            with wrap_errors("connect for LISTEN"):
                conn: asyncpg.Connection = await asyncpg.connect(
                    dsn, timeout=10, server_settings=server_settings(dsn, "listen")
                )
                return conn

        channel = notify_channel(self.schema)
        await listen_shared(dsn, channel, on_wakeup, connect, reconnect_max, log)
