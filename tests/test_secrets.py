"""The DSN's password never reaches a log line, an exception text or a repr (issue 11, defect 6).

structlog's default renderer prints tracebacks with every frame's local
variables (rich): asyncpg's frames hold the DSN and the password, nmbus's the
Settings. These tests run under that default configuration.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg
import pytest
import structlog

from nmbus import Bus, Context, Settings
from nmbus.errors import DatabaseUnavailable
from nmbus.logs import scrub
from nmbus.postgres import PostgresStore
from tests.messages import Ping
from tests.waits import wait_until

PASSWORD = "TopS3cretPW"


def with_login(dsn: str, user: str, password: str = PASSWORD) -> str:
    parts = urlsplit(dsn)
    netloc = f"{user}:{password}@{parts.hostname}:{parts.port or 5432}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@pytest.fixture
def default_structlog() -> Iterator[None]:
    """structlog as an application that never configured it has it."""
    saved = structlog.get_config()
    structlog.reset_defaults()
    try:
        yield
    finally:
        structlog.configure(**saved)


class Output:
    """Everything written to stdout and stderr since the test began."""

    def __init__(self, capfd: pytest.CaptureFixture[str]) -> None:
        self._capfd = capfd
        self.text = ""

    def read(self) -> str:
        captured = self._capfd.readouterr()
        self.text += captured.out + captured.err
        return self.text

    async def wait_for(self, event: str, timeout: float = 15.0) -> None:
        await wait_until(
            lambda: event in self.read(), timeout=timeout, what=f"{event!r} in the output"
        )


@pytest.fixture
def output(capfd: pytest.CaptureFixture[str], default_structlog: None) -> Output:
    return Output(capfd)


@pytest.fixture
async def secret_role(dsn: str, db: asyncpg.Connection) -> AsyncIterator[Callable[[], str]]:
    """A login role with a password (trust auth ignores it, but the DSN carries it)."""
    role = f"nmbus_secret_{uuid.uuid4().hex[:8]}"
    await db.execute(f"CREATE ROLE {role} LOGIN SUPERUSER PASSWORD '{PASSWORD}'")
    try:
        yield lambda: role
    finally:
        await db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role
        )
        await db.execute(f"DROP OWNED BY {role}")
        await db.execute(f"DROP ROLE {role}")


async def test_a_worker_error_never_prints_the_password(
    dsn: str, db: asyncpg.Connection, output: Output
) -> None:
    """The issue's reproduction: the queue table dropped under a running worker."""
    bus = Bus("billing", dsn=with_login(dsn, "postgres"), poll_interval=0.1)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None: ...

    async with bus:
        await db.execute("DROP TABLE nmbus.billing")
        await output.wait_for("worker_error")
    text = output.read()
    assert "UndefinedTableError" in text  # the traceback is still there, as plain text
    assert PASSWORD not in text


async def test_a_worker_that_cannot_log_in_never_prints_the_password(
    dsn: str, db: asyncpg.Connection, secret_role: Callable[[], str], output: Output
) -> None:
    """asyncpg's connect frames hold the DSN and the password as local variables."""
    role = secret_role()
    async with Bus("billing", dsn=dsn, concurrency=0):
        pass  # the queue table, owned by postgres
    bus = Bus("billing", dsn=with_login(dsn, role), poll_interval=0.1)

    @bus.handler
    async def handle(msg: Ping, ctx: Context) -> None: ...

    async with bus:
        await db.execute(f"ALTER ROLE {role} NOLOGIN")
        await db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role
        )
        await output.wait_for("worker_error")
    text = output.read()
    assert "not permitted to log in" in text
    assert PASSWORD not in text


async def test_a_listener_error_never_prints_the_password(dsn: str, output: Output) -> None:
    store = PostgresStore(with_login(dsn, "postgres"))

    def on_wakeup(queue: str) -> None:
        # A frame that holds the DSN, as asyncpg's frames do.
        secret = store.dsn
        raise RuntimeError(f"wake-up of {queue} failed ({len(secret or '')})")

    listener = asyncio.create_task(store.listen(on_wakeup, 0.2))
    try:
        await output.wait_for("listener_failed")
    finally:
        listener.cancel()
        with pytest.raises(asyncio.CancelledError):
            await listener
    text = output.read()
    assert "wake-up of * failed" in text
    assert PASSWORD not in text


async def test_reprs_and_connection_errors_never_show_the_password(dsn: str) -> None:
    secret_dsn = with_login(dsn, "postgres")
    settings = Settings(dsn=secret_dsn)
    bus = Bus("billing", dsn=secret_dsn)
    for text in (repr(settings), str(settings), repr(bus), repr(bus.store), repr(bus.settings)):
        assert PASSWORD not in text
    assert "postgres:***@" in repr(settings)
    assert settings.dsn == secret_dsn  # the one accessor still gives the real DSN

    closed = PostgresStore("postgresql://postgres:TopS3cretPW@127.0.0.1:1/nowhere")
    with pytest.raises(DatabaseUnavailable) as raised:
        await closed.connect()
    for text in (str(raised.value), repr(raised.value), str(raised.value.__cause__)):
        assert PASSWORD not in text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("postgresql://u:TopS3cretPW@h:5432/db", "postgresql://u:***@h:5432/db"),
        ("dsn='postgres://u:p@ss:w@h/db'", "dsn='postgres://u:***@h/db'"),
        (
            "postgresql://h/db?user=u&password=TopS3cretPW&x=1",
            "postgresql://h/db?user=u&password=***&x=1",
        ),
        ("host=h user=u password=TopS3cretPW dbname=d", "host=h user=u password=*** dbname=d"),
        (
            "ConnectionParameters(user='u', password='TopS3cretPW')",
            "ConnectionParameters(user='u', password=***)",
        ),
        ("postgresql://u@h/db and a@b", "postgresql://u@h/db and a@b"),
    ],
)
def test_scrub_hides_passwords_in_every_dsn_form(text: str, expected: str) -> None:
    assert scrub(text) == expected


def test_driver_errors_are_translated_without_the_password() -> None:
    from nmbus.errors import StoreError
    from nmbus.postgres.errors import wrap_errors

    dsn = "postgresql://u:TopS3cretPW@h/db"
    for driver_error in (asyncpg.InterfaceError(f"bad {dsn}"), OSError(f"cannot reach {dsn}")):
        with pytest.raises(StoreError) as raised, wrap_errors("connect"):
            raise driver_error
        assert PASSWORD not in str(raised.value)
        assert "u:***@h" in str(raised.value)


# Passwords that have broken redaction: a comma, '@', '%', a space, a slash,
# quotes, '&', '='. Each is two marked halves: neither half may ever be shown.
HOSTILE_PASSWORDS = ["Xq7,Zv9", "Xq7@Zv9", "Xq7%40Zv9", "Xq7 Zv9", "Xq7/Zv9", "Xq7&x=Zv9", "Xq7Zv9"]


def hostile_dsns(password: str) -> list[str]:
    """Every spelling of a DSN holding ``password`` that a user may write."""
    # libpq ends an unquoted keyword value at a space: such a password is quoted.
    keyword = f"'{password}'" if " " in password else password
    return [
        f"postgresql://app:{password}@db/x",
        f"postgres://app:{password}@db:5432/x?sslmode=require",
        f"PostgreSQL://app:{password}@db/x",
        f"postgresql+asyncpg://app:{password}@db/x",
        f"postgresql:/app:{password}@db/x",
        f"postgresql:app:{password}@db/x",
        f"host=db user=app password={keyword} dbname=x",
        f"host=db password='{password}'",
        # A query value ends at '&': there the password is percent-encoded.
        f"postgresql://db/x?user=app&password={quote(password, safe='')}&sslmode=require",
    ]


HOSTILE = [(p, d) for p in HOSTILE_PASSWORDS for d in hostile_dsns(p)]


def assert_hidden(password: str, *texts: str) -> None:
    halves = password.replace("%40", ",").replace("&x=", ",").replace(" ", ",")
    for half in ("Xq7", "Zv9", *halves.split(",")):
        for text in texts:
            assert half not in text, text


def texts_of(exc: BaseException) -> list[str]:
    """The text, repr and causes' texts of ``exc``: all an operator may see."""
    found: list[str] = []
    seen: BaseException | None = exc
    while seen is not None:
        found += [str(seen), repr(seen)]
        seen = seen.__cause__ or seen.__context__
    return found


@pytest.mark.parametrize(("password", "dsn"), HOSTILE)
def test_scrub_hides_every_hostile_password(password: str, dsn: str) -> None:
    assert_hidden(password, scrub(dsn), scrub(f"failed: {dsn!r} (in {[dsn]})"))


@pytest.mark.parametrize(("password", "dsn"), HOSTILE)
def test_a_route_to_a_hostile_dsn_never_shows_its_password(password: str, dsn: str) -> None:
    """Issue 23 defect 5: the refusal of a route repeated the whole DSN."""
    try:
        bus = Bus("orders", dsn="postgresql://app@db/x", routes={"billing": dsn})
    except Exception as exc:
        from nmbus.errors import InvalidSetting

        assert isinstance(exc, InvalidSetting)
        assert_hidden(password, *texts_of(exc))
    else:  # a spelling asyncpg reads: accepted, and never shown
        assert_hidden(password, repr(bus), repr(bus.settings), repr(bus.store))


@pytest.mark.parametrize(("password", "dsn"), HOSTILE)
@pytest.mark.parametrize(
    "variables",
    [
        lambda dsn: {"NMBUS_DATABASES": dsn},  # no alias
        lambda dsn: {"NMBUS_DATABASES": f"main={dsn}"},
        lambda dsn: {"NMBUS_DATABASES": f"main={dsn}, other=postgresql://o@db/y"},
        lambda dsn: {"NMBUS_DB_MAIN": dsn, "NMBUS_ROUTES": "billing=main"},
        lambda dsn: {"NMBUS_ROUTES": f"billing={dsn}"},
        lambda dsn: {"NMBUS_DSN": dsn, "NMBUS_ROUTES": f"billing={dsn},shipping=nowhere"},
    ],
    ids=["no-alias", "alias", "two", "db-variable", "route", "bad-route"],
)
def test_settings_from_the_environment_never_show_a_hostile_password(
    password: str,
    dsn: str,
    variables: Callable[[str], dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pydantic's ValidationError repeated the input value, and a comma cut a password."""
    from nmbus.settings import build_settings

    for name, value in variables(dsn).items():
        monkeypatch.setenv(name, value)
    for make in (Settings, build_settings):
        try:
            settings = make()
        except Exception as exc:
            assert_hidden(password, *texts_of(exc))
        else:
            assert_hidden(password, repr(settings), str(settings))
            # A password with a comma is read whole, not cut at the comma.
            values = [*settings.databases.values(), *settings.routes.values()]
            assert dsn in values


@pytest.mark.parametrize(
    ("dsn", "reason"),
    [
        (f"postgresql://app:{PASSWORD}@127.0.0.1:99999/x", "Port out of range"),
        (f"postgresql://app:{PASSWORD}@127.0.0.1:abc/x", "Port could not be cast"),
        (f"postgresql://app:{PASSWORD}@nmbus-no-such-host.invalid:99999/x", "Port out of range"),
        (f"postgresql://app:{PASSWORD}@127.0.0.1/x?sslmode=bogus", "sslmode"),
        (f"mysql://app:{PASSWORD}@127.0.0.1/x", "scheme"),
        ("garbage", "scheme"),
    ],
)
async def test_a_bus_on_a_malformed_dsn_says_so_in_one_line(dsn: str, reason: str) -> None:
    """It raised a raw OverflowError or ValueError, or a StoreError naming the driver's class."""
    from nmbus.errors import InvalidSetting

    bus = Bus("orders", dsn=dsn, concurrency=0)
    with pytest.raises(InvalidSetting) as raised:
        async with bus:
            pass
    text = str(raised.value)
    assert text.startswith("invalid DSN ") and reason in text, text
    assert "\n" not in text and PASSWORD not in text and PASSWORD not in repr(raised.value)
    assert "ClientConfigurationError" not in text
