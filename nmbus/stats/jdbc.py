"""Reaching PostgreSQL over JDBC: DSN to JDBC settings, the driver jar, SQL quoting.

Also the one place that turns a JDBC failure into a ``StatsError`` with one
readable line (``jdbc_error``), and the driver-side query helper built on it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from .options import StatsError

JDBC_JAR_CANDIDATES = (
    "/usr/share/java/postgresql.jar",
    "/usr/share/java/postgresql-jdbc4.jar",
)
JDBC_DRIVER = "org.postgresql.Driver"
INSTALL_HINT = (
    "The PostgreSQL JDBC driver was not found. Install Debian's package:\n"
    "    sudo apt-get install libpostgresql-jdbc-java\n"
    "which provides /usr/share/java/postgresql.jar, or point --jdbc-jar (or the\n"
    "NMBUS_JDBC_JAR variable) at a postgresql JDBC jar. With spark-submit pass it as\n"
    "    spark-submit --jars /usr/share/java/postgresql.jar ..."
)


@dataclass
class Jdbc:
    url: str
    user: str | None
    password: str | None = field(repr=False)  # never in a log line or a traceback
    host: str
    port: int
    database: str

    def properties(self, fetch_size: int = 10_000) -> dict[str, str]:
        props = {"driver": JDBC_DRIVER, "fetchsize": str(fetch_size)}
        if self.user:
            props["user"] = self.user
        if self.password:
            props["password"] = self.password
        return props

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}/{self.database}"


def jdbc_from_dsn(dsn: str) -> Jdbc:
    """Turn ``postgresql://user:pw@host:port/db?opts`` (or a jdbc: URL) into JDBC settings."""
    if dsn.startswith("jdbc:"):
        dsn = dsn[len("jdbc:") :]
    parts = urlsplit(dsn)
    if parts.scheme not in ("postgresql", "postgres"):
        # Not the DSN itself: it may hold a password.
        raise StatsError(
            "the DSN must look like postgresql://user@host:5432/db, "
            f"not {parts.scheme + '://...' if parts.scheme else 'a URL without a scheme'}"
        )
    host = parts.hostname or "localhost"
    try:
        port = parts.port or 5432
    except ValueError as exc:
        raise StatsError(f"bad port in DSN: {exc}") from exc
    database = unquote(parts.path.lstrip("/")) or (parts.username or "postgres")
    query = dict(parse_qsl(parts.query))
    user = unquote(parts.username) if parts.username else query.pop("user", None)
    password = unquote(parts.password) if parts.password else query.pop("password", None)
    password = password or os.environ.get("PGPASSWORD")
    netloc_host = f"[{host}]" if ":" in host else host
    url = f"jdbc:postgresql://{netloc_host}:{port}/{database}"
    if query:
        url += "?" + urlencode(query)
    return Jdbc(url, user or os.environ.get("PGUSER"), password, host, port, database)


def check_reachable(jdbc: Jdbc, timeout: float = 5.0) -> None:
    """Fail in seconds, before Spark starts, when nothing listens at the DSN's address."""
    try:
        with socket.create_connection((jdbc.host, jdbc.port), timeout=timeout):
            pass
    except OSError as exc:
        raise StatsError(
            f"cannot reach PostgreSQL at {jdbc.host}:{jdbc.port} ({exc.strerror or exc}); "
            "is the server running and is the DSN right?"
        ) from exc


def find_jdbc_jar(explicit: str | None = None, required: bool = True) -> str | None:
    """The PostgreSQL JDBC jar: ``explicit``, ``$NMBUS_JDBC_JAR`` or Debian's package.

    A jar named explicitly (argument or variable) must exist. When none is found,
    StatsError with the install line, or None when not ``required``.
    """
    for candidate in (explicit, os.environ.get("NMBUS_JDBC_JAR"), *JDBC_JAR_CANDIDATES):
        if candidate and os.path.isfile(candidate):
            return candidate
        if candidate and candidate in (explicit, os.environ.get("NMBUS_JDBC_JAR")):
            raise StatsError(f"JDBC jar {candidate!r} does not exist.\n{INSTALL_HINT}")
    if not required:
        return None
    raise StatsError(INSTALL_HINT)


def check_driver(spark: Any) -> None:
    """Say how to install the JDBC driver when the session cannot load it."""
    jvm = getattr(spark, "_jvm", None)
    if jvm is None:  # Spark Connect: the server's classpath is not ours to check
        return
    try:
        loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
        jvm.java.lang.Class.forName(JDBC_DRIVER, True, loader)
    except Exception as exc:
        raise StatsError(INSTALL_HINT) from exc


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def quote_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def sql_time(value: datetime) -> str:
    return f"TIMESTAMPTZ '{value.astimezone(UTC).isoformat()}'"


def jdbc_error(exc: Exception, jdbc: Jdbc, doing: str) -> StatsError:
    """The first line of what the driver said, or how to install the driver."""
    text = str(exc)
    for marker in ("PSQLException: ", "SQLException: ", "ClassNotFoundException: "):
        if marker in text:
            text = text.split(marker, 1)[1]
            break
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if "ClassNotFound" in str(exc) or "No suitable driver" in str(exc):
        return StatsError(INSTALL_HINT)
    return StatsError(f"{doing} at {jdbc.where} failed: {first}")


def query(spark: Any, jdbc: Jdbc, sql: str, doing: str) -> list[Any]:
    """Run a small query on the driver and collect its rows."""
    try:
        rows: list[Any] = (
            spark.read.format("jdbc")
            .option("url", jdbc.url)
            .option("query", sql)
            .options(**jdbc.properties())
            .load()
            .collect()
        )
    except Exception as exc:
        raise jdbc_error(exc, jdbc, doing) from exc
    return rows
