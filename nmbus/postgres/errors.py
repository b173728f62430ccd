"""The one place where asyncpg and socket errors become nmbus errors."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import asyncpg

from nmbus.errors import DatabaseUnavailable, InvalidSetting, QueueNotFound, StoreError
from nmbus.logs import scrub

_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.TooManyConnectionsError,
)

#: What an operator reads when nmbus meets a transaction pooler it was not told of
#: (nmbus/postgres/pooler.py refuses one at start; these errors say it later).
SET_POOLER = (
    "the DSN reaches a transaction pooler (PgBouncer with pool_mode = transaction?): "
    "set NMBUS_POOLER=transaction (docs/deployment.md, 'Behind PgBouncer')"
)


def pooler_hint(exc: BaseException) -> str | None:
    """:data:`SET_POOLER` when ``exc`` is what a transaction pooler does to a session's
    assumptions: a prepared statement gone (it was on another server connection),
    a startup setting refused."""
    text = str(exc)
    if isinstance(exc, asyncpg.exceptions.InvalidSQLStatementNameError) and "__asyncpg_" in text:
        return SET_POOLER
    if isinstance(exc, asyncpg.exceptions.ProtocolViolationError) and "startup parameter" in text:
        return SET_POOLER
    return None


def is_connection_error(exc: BaseException) -> bool:
    if isinstance(exc, _CONNECTION_ERRORS):
        return True
    if isinstance(exc, asyncpg.InterfaceError) and "closed" in str(exc):
        return True
    # When the server goes away mid-query, asyncpg can leave a pooled connection's
    # protocol half-way through an operation: the next use (or the reset on
    # release) raises InternalClientError ("cannot switch to state ...; another
    # operation is in progress"). Seen only on such broken connections; the
    # statement was not run, and the pool terminates that connection.
    return isinstance(exc, asyncpg.InternalClientError)


@contextmanager
def wrap_errors(what: str) -> Iterator[None]:
    """Translate driver errors raised while doing ``what`` into StoreError."""
    try:
        yield
    except StoreError:
        raise
    except asyncpg.exceptions.UndefinedTableError as exc:
        raise QueueNotFound(f"{what}: {exc}") from exc
    except (
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
        asyncpg.InternalClientError,
        *_CONNECTION_ERRORS,
    ) as exc:  # type: ignore[misc]
        if isinstance(exc, OSError) and exc.filename is not None:
            raise  # a file's error (retention's archive, say), not the database's
        # A driver's text may quote the DSN it was given: never its password.
        if hint := pooler_hint(exc):
            # The driver's own advice about PgBouncer runs over many lines: its first is enough.
            said = scrub(str(exc)).splitlines()[0]
            raise StoreError(f"{what}: {hint} ({type(exc).__name__}: {said})") from exc
        if is_connection_error(exc):
            raise DatabaseUnavailable(f"{what}: database unavailable ({_why(exc)})") from exc
        if isinstance(exc, asyncpg.exceptions.QueryCanceledError):
            raise StoreError(
                f"{what}: the server cancelled the statement ({scrub(str(exc))}): it took "
                "longer than the session's statement_timeout (the server's, the database's "
                "or the role's), or an operator cancelled it"
            ) from exc
        raise StoreError(f"{what}: {type(exc).__name__}: {scrub(str(exc))}") from exc


@contextmanager
def wrap_connect_errors(dsn: str | None, *, unavailable: bool = True) -> Iterator[None]:
    """Translate a failure to connect to ``dsn`` into one an operator can act on.

    A DSN that cannot work raises InvalidSetting (``invalid DSN ...``), a server
    that cannot be reached or refuses the connection DatabaseUnavailable
    (``cannot connect to ...``); both name the DSN, without its password. With
    ``unavailable=False`` only the first is translated: any other error goes on
    as raised, for the caller's own translation (wrap_errors).
    """
    shown = scrub(dsn or "")
    try:
        yield
    except (asyncpg.exceptions.ClientConfigurationError, ValueError, OverflowError) as exc:
        reason = scrub(str(exc).removeprefix("invalid DSN: "))
        raise InvalidSetting(f"invalid DSN {shown}: {_port_problem(dsn) or reason}") from exc
    except (
        OSError,
        TimeoutError,
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
        asyncpg.exceptions.TargetServerAttributeNotMatched,
    ) as exc:
        if problem := _port_problem(dsn):
            raise InvalidSetting(f"invalid DSN {shown}: {problem}") from exc
        if not unavailable:
            raise
        raise DatabaseUnavailable(f"cannot connect to {shown}: {_why(exc)}") from exc


def _why(exc: BaseException) -> str:
    """The driver's reason, without a password; in words for a DSN that found no primary."""
    if isinstance(exc, asyncpg.exceptions.TargetServerAttributeNotMatched):
        # Each server named answered, none takes writes: a failover under way (no
        # standby promoted yet), or a DSN that names only standbys.
        return "no server of the DSN takes writes now (target_session_attrs=read-write)"
    return scrub(str(exc))


def _port_problem(dsn: str | None) -> str | None:
    """Why a port of a URL-style DSN cannot be one (asked only after a failure)."""
    try:
        servers = urlsplit(dsn or "").netloc.rpartition("@")[2]
        # A DSN may name several servers (host1:5432,host2:5432): each its own port.
        for server in servers.split(","):
            _ = urlsplit(f"//{server}").port  # a property that checks the port
    except ValueError as exc:
        return str(exc)
    return None


def driver_error_line(exc: BaseException) -> str | None:
    """One line for an operator when ``exc`` is a driver error nmbus did not translate.

    The command line's last resort (tools that talk to asyncpg directly);
    None for anything that is not asyncpg's.
    """
    if isinstance(exc, asyncpg.exceptions.ClientConfigurationError):
        return scrub(f"invalid DSN: {str(exc).removeprefix('invalid DSN: ')}")
    if isinstance(exc, asyncpg.PostgresError):
        return scrub(f"the database said: {exc}")
    return None


class _PoolFloorInOneLine(logging.Filter):
    """asyncpg's pool, while it cannot reconnect the connections it keeps open
    (a failover, a full ``max_connections``), logs every retry with a traceback:
    here each retry is its one line, with the error's first line, password-free."""

    PREFIX = "Failed to restore the pool connection floor"

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and str(record.msg).startswith(self.PREFIX):
            exc = record.exc_info[1]
            if exc is not None:
                said = (scrub(str(exc)).splitlines() or [""])[0]
                record.msg = f"{record.getMessage()} ({type(exc).__name__}: {said})"
                record.args = ()
            record.exc_info, record.exc_text = None, None
        return True


def quiet_pool_floor() -> None:
    """Install :class:`_PoolFloorInOneLine` on asyncpg's pool logger, once."""
    pool_log = logging.getLogger("asyncpg.pool")
    if not any(isinstance(f, _PoolFloorInOneLine) for f in pool_log.filters):
        pool_log.addFilter(_PoolFloorInOneLine())


# Every pool nmbus opens is asyncpg's: its retries are one line each from the start.
quiet_pool_floor()
