"""Health probes and the autoscaler's query, on a real PostgreSQL.

``/healthz`` and ``/readyz`` of a worker process (``nmbus worker``, a real
subprocess) and of a bus in this process; ``nmbus health`` as an exec probe
runs it; ``sql/cookbook/ready_backlog.sql`` over rows whose fate is known, in
two segments, with flow limits; and the KEDA query of docs/deployment.md is
that file's statement.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import asyncpg

from nmbus import Bus, Context
from nmbus.ports.store import SCHEMA_VERSION
from nmbus.postgres.segments import roll_now
from tests.cookbook_run import COOKBOOK, psql
from tests.health_app import Hold, Quit
from tests.pg import Databases
from tests.segment_rows import make_queue
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parent.parent


def get(port: int, path: str) -> tuple[int, str]:
    """GET ``path`` of the port: the status and the body's text."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def probe(port: int, path: str) -> tuple[int, str]:
    return await asyncio.to_thread(get, port, path)


# -- a worker process --------------------------------------------------------------------


@contextmanager
def worker(dsn: str) -> Iterator[subprocess.Popen[str]]:
    env = {**os.environ, "NMBUS_DSN": dsn, "NMBUS_METRICS_PORT": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "nmbus", "worker", "tests.health_app:make_bus"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


async def started_port(proc: subprocess.Popen[str], seen: list[str]) -> int:
    """The metrics port of the worker's bus_started line (stderr lines go to ``seen``)."""
    assert proc.stderr is not None
    async with asyncio.timeout(60):
        while "bus_started" not in (line := await asyncio.to_thread(proc.stderr.readline)):
            assert line, "the worker exited before starting"
            seen.append(line)
    seen.append(line)
    match = re.search(r"metrics_port=(\d+)", line)
    assert match, line
    return int(match.group(1))


async def printed(proc: subprocess.Popen[str], prefix: str) -> str:
    """The rest of the worker's next stdout line that starts with ``prefix``."""
    assert proc.stdout is not None
    async with asyncio.timeout(60):
        while not (line := await asyncio.to_thread(proc.stdout.readline)).startswith(prefix):
            assert line, f"the worker exited before printing {prefix!r}"
    return line.removeprefix(prefix).strip()


def loop_name(task_name: str) -> str:
    """``nmbus-worker-probed-1`` -> ``loop-1``, as /healthz names it."""
    return f"loop-{task_name.rsplit('-', 1)[1]}"


async def test_healthz_names_the_loop_that_stopped_and_the_one_that_blocks(dsn: str) -> None:
    with worker(dsn) as proc:
        logged: list[str] = []
        port = await started_port(proc, logged)
        found = await probe(port, "/healthz")
        assert found == (200, "ok: running loop-0, loop-1, listener, leases\n"), found
        assert await probe(port, "/readyz") == (
            200,
            f"ready: schema 'nmbus' at version {SCHEMA_VERSION}, queue 'probed'\n",
        )

        async with Bus("sender", dsn=dsn, concurrency=0) as sender:
            # One loop ends: its handler cancels the loop's own task, which nothing restarts.
            await sender.send(Quit(), to="probed")
            ended = loop_name(await printed(proc, "ending "))
            other = "loop-1" if ended == "loop-0" else "loop-0"
            found = await wait_until(
                lambda: probe(port, "/healthz"), until=lambda r: r[0] == 503, timeout=30
            )
            assert found == (503, f"stopped: {ended} (cancelled)\n"), found
            # Liveness is not readiness: the database still answers as expected.
            found = await probe(port, "/readyz")
            assert found[0] == 200, found

            # The other loop holds the event loop with time.sleep: blocked, and named.
            await sender.send(Hold(seconds=15.0), to="probed")
            assert loop_name(await printed(proc, "holding ")) == other
            status, body = await wait_until(
                lambda: probe(port, "/healthz"),
                until=lambda r: r[1].startswith("blocked:"),
                timeout=30,
                interval=0.2,
            )
            assert status == 503, body
            assert re.fullmatch(
                rf"blocked: {other} has held the event loop for \d+\.\d s without awaiting"
                r" \(listener, leases wait behind it\)\n",
                body,
            ), body
            # Nothing on the loop can answer meanwhile: not ready either.
            status, body = await probe(port, "/readyz")
            assert status == 503 and "no answer within 3 s" in body, body

            # Once the loop turns again it is no longer blocked; the ended loop stays ended.
            status, body = await wait_until(
                lambda: probe(port, "/healthz"),
                until=lambda r: not r[1].startswith("blocked:"),
                timeout=60,
                interval=0.2,
            )
            assert status == 503 and body.startswith(f"stopped: {ended} (cancelled)"), body

        for _ in range(20):
            await probe(port, "/healthz")
            await probe(port, "/readyz")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 60) == 0
        assert proc.stderr is not None
        logged.extend(proc.stderr.read().splitlines())
    # Quiet: a probe writes no line (the lines are the worker's own events).
    assert not [line for line in logged if "healthz" in line or "readyz" in line or "GET" in line]


# -- readiness of a bus in this process ----------------------------------------------------


async def test_readyz_is_503_while_the_schema_version_differs(
    make_bus: Callable[..., Bus], db: asyncpg.Connection
) -> None:
    async with make_bus("probed", metrics_port=0, concurrency=0) as bus:
        port = bus.metrics_port
        assert port is not None
        assert (await probe(port, "/readyz"))[0] == 200
        await db.execute("INSERT INTO nmbus.schema_version VALUES ($1)", SCHEMA_VERSION + 1)
        assert await probe(port, "/readyz") == (
            503,
            f"not ready: schema 'nmbus' is at version {SCHEMA_VERSION + 1}, newer than this "
            f"nmbus understands ({SCHEMA_VERSION}): upgrade nmbus\n",
        )
        assert (await probe(port, "/healthz"))[0] == 200  # alive, only not ready
        await db.execute("DELETE FROM nmbus.schema_version WHERE version > $1", SCHEMA_VERSION)
        assert (await probe(port, "/readyz"))[0] == 200
        await db.execute("INSERT INTO nmbus.schema_version VALUES ($1)", SCHEMA_VERSION - 1)
        await db.execute("DELETE FROM nmbus.schema_version WHERE version = $1", SCHEMA_VERSION)
        assert await probe(port, "/readyz") == (
            503,
            f"not ready: schema 'nmbus' is at version {SCHEMA_VERSION - 1}, older than this "
            f"nmbus expects ({SCHEMA_VERSION}): a starting Bus migrates it\n",
        )
        await db.execute("INSERT INTO nmbus.schema_version VALUES ($1)", SCHEMA_VERSION)
        await db.execute('DROP TABLE nmbus."probed" CASCADE')
        assert await probe(port, "/readyz") == (
            503,
            "not ready: no queue 'probed' in schema 'nmbus'\n",
        )


async def test_readyz_is_503_once_the_database_is_gone(databases: Databases) -> None:
    with databases.fresh() as dsn:
        bus = Bus("probed", dsn=dsn, metrics_port=0, concurrency=1, poll_interval=0.5)
        async with bus:
            port = bus.metrics_port
            assert port is not None
            assert (await probe(port, "/readyz"))[0] == 200
            conn = await asyncpg.connect(databases.server)
            try:
                name = dsn.rsplit("/", 1)[1]
                await conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
            finally:
                await conn.close()
            # The first check may meet a pooled connection the drop ended, the next one
            # cannot connect: either way not ready, and then because the database is gone.
            status, body = await probe(port, "/readyz")
            assert status == 503 and body.startswith("not ready: check readiness: "), body
            status, body = await wait_until(
                lambda: probe(port, "/readyz"),
                until=lambda r: f'database "{name}" does not exist' in r[1],
                timeout=30,
                interval=0.2,
            )
            assert status == 503 and body.startswith("not ready: check readiness: "), body
            # Its loops are alive, reconnecting: not a reason to restart the process.
            assert await probe(port, "/healthz") == (200, "ok: running loop-0, listener, leases\n")
        assert bus.metrics_port is None


async def test_probes_answer_only_get_and_metrics_stay_where_they_were(
    make_bus: Callable[..., Bus],
) -> None:
    async with make_bus("probed", metrics_port=0, concurrency=0) as bus:
        port = bus.metrics_port
        assert port is not None

        def post() -> int:
            request = urllib.request.Request(f"http://127.0.0.1:{port}/healthz", method="POST")
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return int(response.status)
            except urllib.error.HTTPError as exc:
                return exc.code

        assert await asyncio.to_thread(post) == 405
        for path in ("/metrics", "/"):
            status, body = await probe(port, path)
            assert status == 200 and "nmbus_batch_size" in body


# -- nmbus health ---------------------------------------------------------------------------


async def health(dsn: str, *args: str) -> tuple[int, list[str]]:
    """``nmbus health ARGS`` with NMBUS_DSN: its exit code and every line it printed."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "nmbus", "health", *args,
        cwd=ROOT, env={**os.environ, "NMBUS_DSN": dsn},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, (out + err).decode().splitlines()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_nmbus_health_exit_codes_and_its_one_line(dsn: str, db: asyncpg.Connection) -> None:
    await make_queue(dsn, "probed")
    where = "127.0.0.1:5432/" + dsn.rsplit("/", 1)[1]
    closed = f"postgresql://postgres:s3cret@127.0.0.1:{_closed_port()}/nowhere"
    ok, missing, down, bad = await asyncio.gather(
        health(dsn, "probed"),
        health(dsn, "nosuch"),
        health(closed, "probed"),
        health(dsn, "Bad name!"),
    )
    assert ok == (
        0,
        [f"ok: queue 'probed', schema 'nmbus' at version {SCHEMA_VERSION}, on {where}"],
    )
    assert missing == (1, [f"error: no queue 'nosuch' in schema 'nmbus' ({where})"])
    code, lines = down
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: cannot connect to ")
    assert "s3cret" not in lines[0]
    code, lines = bad
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: invalid queue name")

    await db.execute("INSERT INTO nmbus.schema_version VALUES ($1)", SCHEMA_VERSION + 1)
    code, lines = await health(dsn, "probed")
    assert code == 1 and len(lines) == 1 and "newer than this nmbus understands" in lines[0]
    await db.execute("DROP SCHEMA nmbus CASCADE")
    assert await health(dsn, "probed") == (
        1,
        [f"error: no nmbus schema 'nmbus' in this database ({where})"],
    )


async def test_nmbus_health_gives_up_after_its_timeout() -> None:
    """A server that accepts the connection and never answers: one line after --timeout."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        port = silent.getsockname()[1]
        silent_dsn = f"postgresql://x@127.0.0.1:{port}/db"
        code, lines = await health(silent_dsn, "probed", "--timeout", "1")
    finally:
        silent.close()
    assert (code, lines) == (1, [f"error: no answer from 127.0.0.1:{port}/db within 1 s"])


# -- the ready backlog -----------------------------------------------------------------------


LIMITS = """
INSERT INTO nmbus."flow$limits" (queue, key, limits, labels, concurrency, starts, window_s,
                                 group_concurrency, declared_by)
VALUES ('work', 'pay.Charge:charge', 'concurrency=2', '{pay.Charge}', 2, NULL, NULL, NULL, 't'),
       ('work', 'exp.Export:export', 'group_concurrency=1', '{exp.Export}', NULL, NULL, NULL, 1,
        't'),
       ('work', 'mail.Send:send', 'rate=3', '{mail.Send}', NULL, 3, 1.0, NULL, 't'),
       ('other', 'pay.Charge:charge', 'concurrency=1', '{pay.Charge}', 1, NULL, NULL, NULL, 't')
"""


async def rows(db: asyncpg.Connection, label: str, n: int, **columns: object) -> list[int]:
    """``n`` rows of ``label`` in nmbus.work (ready in I unless ``columns`` say otherwise)."""
    values = {
        "subqueue": "I",
        "retry_time": "now() - interval '1 minute'",
        "msg_headers": "'{}'",
        "handling_client_id": "NULL",
        "lease_expires": "NULL",
        "retry_count": "0",
        "sequence_key": "NULL",
        **{k: str(v) for k, v in columns.items()},
    }
    names = ", ".join(values)
    exprs = ", ".join(
        f"'{v}'" if k == "subqueue" else f"({v})::{_TYPES[k]}" for k, v in values.items()
    )
    found = await db.fetch(
        f"""INSERT INTO nmbus.work (from_endpoint, to_endpoint, label, msg_text, {names})
            SELECT 'shop', 'work', $1, '{{}}', {exprs} FROM generate_series(1, $2::int)
            RETURNING id""",
        label,
        n,
    )
    return [r[0] for r in found]


_TYPES = {
    "retry_time": "timestamptz",
    "msg_headers": "jsonb",
    "handling_client_id": "text",
    "lease_expires": "timestamptz",
    "retry_count": "int",
    "sequence_key": "text",
}


async def flight(db: asyncpg.Connection, key: str, group: str = "", started: bool = False) -> None:
    """A limited message in flight: its row leased by the claim its flight names."""
    (id,) = await rows(
        db,
        key.split(":")[0],
        1,
        handling_client_id="'claim-1'",
        lease_expires="now() + interval '1 minute'",
        retry_count=1,
        msg_headers=f"""'{{"nmbus-group": "{group}"}}'""" if group else "'{}'",
    )
    await db.execute(
        'INSERT INTO nmbus."flow$flights" (queue, key, group_key, id, client, attempt, started) '
        "VALUES ('work', $1, $2, $3, 'claim-1', 1, CASE WHEN $4 THEN now() END)",
        key,
        group,
        id,
        started,
    )


def group(name: str) -> str:
    return f"""'{{"nmbus-group": "{name}"}}'"""


async def test_ready_backlog_counts_what_more_workers_could_start(
    dsn: str, db: asyncpg.Connection
) -> None:
    await make_queue(dsn, "work")
    # Segment 0: ready rows of a type without limits, and rows that are not ready.
    await rows(db, "free.Job", 3)  # ready in I: 3
    await rows(db, "free.Job", 1, subqueue="R")  # due in R: 1
    await rows(db, "free.Job", 1, subqueue="R", retry_time="now() + interval '1 hour'")
    await rows(db, "free.Job", 1, handling_client_id="'w'", lease_expires="now() + interval '1m'")
    await rows(db, "free.Job", 1, handling_client_id="'w'", lease_expires="now() - interval '1m'")
    await rows(db, "free.Job", 2, subqueue="X")
    await rows(db, "free.Job", 1, subqueue="F")
    # A sequence: its head is ready (1); the member behind it is not, parked or not.
    await rows(db, "free.Job", 1, sequence_key="'s1'")
    await rows(db, "free.Job", 1, sequence_key="'s1'")
    await rows(db, "free.Job", 1, sequence_key="'s1'", retry_time="'infinity'")
    # Segment 1: the queue rolled; its ready rows count too (2).
    assert await roll_now(db, "nmbus", "work") is not None
    await rows(db, "free.Job", 2)
    segments = await db.fetchval(
        "SELECT count(DISTINCT tableoid) FROM nmbus.work WHERE label = 'free.Job'"
    )
    assert segments == 2
    unlimited = 3 + 1 + 1 + 1 + 2
    assert await backlog(dsn) == unlimited

    await db.execute(LIMITS)
    # concurrency=2 with one in flight: 1 of its 5 ready (one by its type chain) can start.
    await flight(db, "pay.Charge:charge")
    await rows(db, "pay.Charge", 4)
    chain = """'{"nmbus-type-chain": "pay.ChargeV2,pay.Charge"}'"""
    await rows(db, "pay.ChargeV2", 1, msg_headers=chain)
    # group_concurrency=1: group a has one running (0 more), b 1 of 2, no group 2 of 2,
    # and c 1 (a subclass's message, by its type chain).
    await flight(db, "exp.Export:export", group="a")
    await rows(db, "exp.Export", 3, msg_headers=group("a"))
    await rows(db, "exp.Export", 2, msg_headers=group("b"))
    await rows(db, "exp.Export", 2)
    subclass = """'{"nmbus-group": "c", "nmbus-type-chain": "exp.ExportV2,exp.Export"}'"""
    await rows(db, "exp.ExportV2", 1, msg_headers=subclass)
    # rate=3 a second with one start in the window: 2 of its 10.
    await flight(db, "mail.Send:send", started=True)
    await rows(db, "mail.Send", 10)
    assert await backlog(dsn) == unlimited + 1 + 4 + 2

    # Limits lifted: every ready message counts again (the rows in flight do not).
    await db.execute("""DELETE FROM nmbus."flow$limits" WHERE queue = 'work'""")
    assert await backlog(dsn) == unlimited + 5 + 8 + 10


async def backlog(dsn: str) -> int:
    got = await psql(dsn, "ready_backlog.sql", queue="work")
    assert len(got) == 1 and list(got[0]) == ["ready_backlog"]
    return int(got[0]["ready_backlog"])


def keda_query() -> str:
    """The query of the ScaledObject in docs/deployment.md."""
    text = (ROOT / "docs" / "deployment.md").read_text()
    match = re.search(r"^ {8}query: \|\n((?: {10}.*\n|\n)+)", text, re.M)
    assert match, "docs/deployment.md has no ScaledObject query"
    return "\n".join(line[10:] for line in match.group(1).splitlines()).strip()


def rendered(queue: str, schema: str = "nmbus") -> str:
    """ready_backlog.sql's statement with the psql variables filled in, as KEDA needs it."""
    text = (COOKBOOK / "ready_backlog.sql").read_text()
    statement = text[text.index("WITH ready AS") :].strip()
    return (
        statement.replace(':"schema"', f'"{schema}"')
        .replace(':"queue"', f'"{queue}"')
        .replace(":'queue'", f"'{queue}'")
    )


async def test_the_keda_query_is_the_cookbook_statement(dsn: str, db: asyncpg.Connection) -> None:
    """Run without psql, as KEDA runs it, it says what the file says."""
    assert keda_query() == rendered("billing")
    await make_queue(dsn, "billing")
    await db.execute(
        "INSERT INTO nmbus.billing (from_endpoint, to_endpoint, label, msg_text) "
        "SELECT 'shop', 'billing', 'test.Ping', '{}' FROM generate_series(1, 4)"
    )
    assert await db.fetchval(keda_query()) == 4
    assert await db.fetchval(rendered("billing")) == int(
        (await psql(dsn, "ready_backlog.sql", queue="billing"))[0]["ready_backlog"]
    )


async def test_a_handler_run_beside_others_is_named_after_its_loop(
    make_bus: Callable[..., Bus],
) -> None:
    """With handler_concurrency > 1 a handler runs in a task of its own, named after its loop."""
    async with make_bus("sender", concurrency=0) as sender:
        for _ in range(2):
            await sender.send(Hold(seconds=6.0), to="probed")
    bus = make_bus("probed", metrics_port=0, handler_concurrency=2)
    holding = threading.Event()

    @bus.handler
    async def hold(msg: Hold, ctx: Context) -> None:
        holding.set()
        time.sleep(msg.seconds)  # blocks this test's own event loop: probed from a thread

    seen: list[str] = []

    def watch(port: int) -> None:
        assert holding.wait(60)
        for _ in range(300):
            body = get(port, "/healthz")[1]
            if body.startswith("blocked:"):
                seen.append(body)
                return
            time.sleep(0.1)

    async with bus:
        port = bus.metrics_port
        assert port is not None
        watcher = threading.Thread(target=watch, args=(port,))
        watcher.start()
        await asyncio.to_thread(watcher.join)
    assert seen and seen[0].startswith("blocked: loop-0 (handler) has held the event loop"), seen
