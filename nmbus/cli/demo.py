"""``nmbus demo``: services exchange orders live, some fail and retry, then the report.

With ``--dsn`` / ``NMBUS_DSN`` it uses that server (schema ``nmbus_demo`` only);
without, the embedded PostgreSQL in ``--data-dir`` (``.nmbus``). This module
imports the demo's services and message types, so it is loaded only when the
command runs (see NmbusGroup.lazy).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, TextIO

import structlog
import typer
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from nmbus.cli._common import fail, server_address
from nmbus.cli._table import Column, Grid
from nmbus.demo import report as demo_report
from nmbus.demo import services as demo_lib
from nmbus.demo.embedded import DEFAULT_DATA_DIR, EmbeddedPostgres
from nmbus.errors import NmbusError
from nmbus.logs import scrub

command = typer.Typer(add_completion=False)

console = Console()
errors = Console(stderr=True)


def _configure_logging(path: Path) -> TextIO:
    """The services log JSON lines to a file, so the live view stays readable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("w", encoding="utf-8")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.WriteLoggerFactory(file=handle),
        cache_logger_on_first_use=False,
    )
    return handle


class LiveView:
    """Progress bars for orders and a table of every queue's subqueues."""

    def __init__(self, orders: int) -> None:
        self.progress = Progress(
            TextColumn("{task.description:<26}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        self.published = self.progress.add_task("orders published", total=orders)
        self.settled = self.progress.add_task("orders through billing", total=orders)
        self.table: Grid | None = None
        self.last: demo_lib.Snapshot | None = None

    def update(self, snap: demo_lib.Snapshot) -> None:
        self.last = snap
        self.progress.update(self.published, completed=snap.published)
        self.progress.update(self.settled, completed=snap.settled)
        self.table = queue_table(snap)

    def __rich__(self) -> Group:
        return Group(self.progress, *([self.table] if self.table else []))


def queue_table(snap: demo_lib.Snapshot) -> Grid:
    def coloured(n: int, style: str) -> Text:
        return Text(f"{n:,}", style=style if n else "")

    return Grid(
        f"queues after {snap.elapsed:.1f}s "
        f"({snap.attempts_failed} failed attempts, {snap.declined} cards declined)",
        [
            Column("queue", key=True),
            "ready (I)",
            "scheduled (R)",
            Column("processed (X)", align="right"),
            Column("failed (F)", align="right"),
            "per second",
        ],
        [
            [
                q.queue,
                q.ready,
                q.scheduled,
                coloured(q.processed, "green"),
                coloured(q.failed, "red"),
                round(q.processed / snap.elapsed) if snap.elapsed > 0 else 0,
            ]
            for q in snap.queues
        ],
    )


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.2%}"


def report_table(summary: dict[str, Any]) -> Grid:
    rows = [*summary.get("queues", [])]
    if "overall" in summary:
        rows.append({"queue": "all", **summary["overall"]})
    latency = "queue latency"
    return Grid(
        "statistics report (Spark; queue latency in ms)",
        [
            Column("queue", key=True),
            "processed",
            "failed",
            Column("failure rate", align="right"),
            Column("p50 ms", align="right", group=latency),
            Column("p95 ms", align="right", group=latency),
            Column("p99 ms", align="right", group=latency),
        ],
        [
            [
                str(q.get("queue")),
                q.get("processed", 0),
                q.get("failed", 0),
                _percent(q.get("failure_rate")),
                *(_ms((q.get("queue_latency_ms") or {}).get(p)) for p in ("p50", "p95", "p99")),
            ]
            for q in rows
        ],
    )


@contextlib.contextmanager
def _live(view: LiveView, say: Console) -> Iterator[None]:
    """The live view; when the run fails, its last line is ended so the error starts a line."""
    try:
        with Live(view, console=say, refresh_per_second=4, transient=False):
            yield
    except BaseException:
        if not say.is_terminal:  # on a terminal, Live ends its line itself
            say.line()
        raise


def _say_machine_changes(say: Console, server: EmbeddedPostgres) -> None:
    """As root, say on the terminal (not only in the log) what the server's start changed."""
    if server.system_user is None:
        return
    say.print(
        f"[yellow]as root:[/yellow] the embedded PostgreSQL runs as the system user "
        f"{server.system_user} (PostgreSQL refuses to run as root)",
        highlight=False,
    )
    for change in server.machine_changes:
        say.print(f"  {escape(change)}", highlight=False)


# What the demo writes into --data-dir besides an embedded server.
DEMO_LOG = "demo.log"
SPARK_LOG = "spark.log"


def _clean(dsn: str | None, data_dir: Path, schema: str, out: Path) -> None:
    if dsn:
        dropped = asyncio.run(demo_lib.drop_schema(dsn, schema))
        console.print(
            f"schema {schema} {'dropped' if dropped else 'was not there'} "
            f"on {server_address(dsn)} (--dsn / NMBUS_DSN)",
            highlight=False,
        )
        _remove_logs(data_dir)
    else:
        server = EmbeddedPostgres(data_dir)
        existed = server.pgdata.exists()
        server.destroy()
        console.print(
            f"embedded PostgreSQL stopped and {server.data_dir} removed"
            if existed
            else f"no embedded PostgreSQL in {server.data_dir}",
            highlight=False,
        )
    if out.exists():
        shutil.rmtree(out)
        console.print(f"report folder {out} removed", highlight=False)
    _name_class_cache()


def _name_class_cache() -> None:
    """Say where Spark's class cache is, and keep it.

    It is not the demo's: one folder of this user (~/.cache/nmbus) holds the
    archives of every nmbus report, whatever the project, so removing it here
    would cost other projects' next reports their fast start.
    """
    from nmbus.stats import classcache

    folder = classcache.cache_folder()
    if folder is None or not folder.is_dir():
        return
    size, archives = classcache.usage(folder)
    if not size:
        return
    console.print(
        f"kept Spark's class cache {folder} ({size / 1e6:,.0f} MB, {archives} archive(s)): "
        "it is shared by the nmbus reports of every project of this user. "
        f"To remove it: rm -r {folder} (NMBUS_SPARK_CLASS_CACHE=off: never make it)",
        highlight=False,
        soft_wrap=True,
    )


def _remove_logs(data_dir: Path) -> None:
    """The demo's logs, then the folder if nothing else is in it (an embedded server stays)."""
    for name in (DEMO_LOG, SPARK_LOG):
        (data_dir / name).unlink(missing_ok=True)
    if data_dir.is_dir() and not any(data_dir.iterdir()):
        data_dir.rmdir()
        console.print(f"folder {data_dir} removed", highlight=False)
    elif data_dir.is_dir():
        console.print(
            f"{data_dir} kept: it holds an embedded PostgreSQL "
            "(`nmbus demo --clean` without NMBUS_DSN removes it)",
            highlight=False,
        )


@command.command()
def demo(
    orders: Annotated[int, typer.Option(min=1, help="orders the shop publishes")] = 3000,
    dsn: Annotated[
        str | None,
        typer.Option(
            envvar="NMBUS_DSN", help="PostgreSQL DSN; without one an embedded server is used"
        ),
    ] = None,
    data_dir: Annotated[
        Path, typer.Option(help="folder of the embedded PostgreSQL and the demo's log")
    ] = DEFAULT_DATA_DIR,
    schema: Annotated[str, typer.Option(help="schema of the demo's tables")] = (
        demo_lib.DEFAULT_SCHEMA
    ),
    out: Annotated[Path, typer.Option(help="folder of the statistics report")] = Path(
        "nmbus-report"
    ),
    report: Annotated[bool, typer.Option(help="run the Spark statistics report")] = True,
    concurrency: Annotated[int, typer.Option(min=1, help="worker loops per service")] = 2,
    flaky_rate: Annotated[
        float, typer.Option(help="chance, 0 to below 1, that an attempt fails and is retried")
    ] = 0.12,
    seed: Annotated[int, typer.Option(help="seed of the orders and the failures")] = 7,
    keep_running: Annotated[
        bool,
        typer.Option("--keep-running", help="leave the embedded PostgreSQL running afterwards"),
    ] = False,
    clean: Annotated[
        bool,
        typer.Option(
            "--clean",
            help="drop the demo schema (or stop and delete the embedded server) and the report",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the outcome as JSON")] = False,
) -> None:
    """Run a small shop on the bus: live progress, failures and retries, then the report."""
    if clean:
        try:
            _clean(dsn, data_dir, schema, out)
        except (NmbusError, OSError) as exc:
            fail(str(exc))
        return
    options = demo_lib.DemoOptions(
        orders=orders, schema=schema, concurrency=concurrency, flaky_rate=flaky_rate, seed=seed
    )
    try:
        options.check()
    except NmbusError as exc:
        fail(str(exc), code=2)  # a bad option
    quiet = as_json
    say = errors if quiet else console
    if not dsn:
        # No server at all is the first thing to say: nothing else can run.
        try:
            EmbeddedPostgres.check_installed()
        except NmbusError as exc:
            fail(str(exc))

    # Say at once what the report will need, but run the bus part in any case.
    report_problem: str | None = None
    if report:
        try:
            demo_report.check_report()
        except demo_report.ReportUnavailable as exc:
            report_problem = str(exc)
            say.print(f"[yellow]note:[/yellow] {escape(report_problem)}", highlight=False)
            say.print("the bus part runs anyway; the report is skipped.\n", highlight=False)

    log_path = data_dir / DEMO_LOG
    log_file = _configure_logging(log_path)
    server: EmbeddedPostgres | None = None
    was_running = False
    if not dsn:
        server = EmbeddedPostgres(data_dir)
        was_running = server.status() is not None
        try:
            with say.status(f"starting the embedded PostgreSQL in {server.pgdata} ..."):
                dsn = server.start()
        except NmbusError as exc:
            _say_machine_changes(say, server)
            structlog.reset_defaults()
            log_file.close()
            fail(str(exc))
        _say_machine_changes(say, server)
        say.print(f"embedded PostgreSQL: [bold]{escape(dsn)}[/bold]", highlight=False)
    else:
        say.print(
            f"PostgreSQL server (--dsn / NMBUS_DSN): [bold]{escape(server_address(dsn))}[/bold], "
            f"schema {escape(schema)} only",
            highlight=False,
        )
    outcome: dict[str, Any] = {
        "dsn": scrub(dsn),
        "server": server_address(dsn),
        "schema": schema,
        "log": str(log_path),
    }
    try:
        # A server or database that is not there is said before any progress is drawn.
        asyncio.run(demo_lib.reach(dsn))
        view = LiveView(orders)
        with _live(view, say):
            result = asyncio.run(demo_lib.run_bus(dsn, options, on_progress=view.update))
        outcome["bus"] = _bus_outcome(result)
        if not quiet:
            _print_bus(result)
        if report and report_problem is None:
            say.print(
                f"\nrunning the Spark statistics job (local[2], its log: {data_dir / SPARK_LOG})"
                " ...",
                highlight=False,
            )
            try:
                stats = demo_report.run_report(dsn, options, out, jvm_log=data_dir / SPARK_LOG)
            except demo_report.ReportUnavailable as exc:
                say.print(f"[red]report failed:[/red] {escape(str(exc))}", highlight=False)
                outcome["report"] = {"error": str(exc)}
            else:
                html = Path(stats.html_path).resolve()
                outcome["report"] = {
                    "html": str(html),
                    "json": str(Path(stats.json_path).resolve()),
                    "rows": stats.rows,
                    "seconds": round(stats.seconds, 2),
                }
                if not quiet:
                    console.print()
                    console.print(report_table(stats.summary))
                    console.print(f"HTML report: [bold]{html}[/bold]", highlight=False)
                    console.print(f"open it:     [bold]{html.as_uri()}[/bold]", highlight=False)
        elif report_problem is not None:
            outcome["report"] = {"skipped": report_problem}
    except (NmbusError, OSError, TimeoutError) as exc:
        fail(f"{type(exc).__name__}: {exc}")
    finally:
        try:
            if server is not None and not keep_running and not was_running:
                server.stop()
                outcome["embedded"] = "stopped"
        finally:
            structlog.reset_defaults()
            log_file.close()
    if as_json:
        typer.echo(json.dumps(outcome, indent=2))
        return
    console.print(f"\nservice logs (JSON lines): {log_path}", highlight=False)
    if server is not None and (keep_running or was_running):
        console.print(
            f"the embedded PostgreSQL keeps running at {dsn}; "
            f"look at the rows: psql {dsn} -c 'SELECT * FROM {schema}.billing LIMIT 5'",
            highlight=False,
        )
    elif server is not None:
        console.print(
            "the embedded PostgreSQL is stopped (its data stays in "
            f"{server.pgdata}); `nmbus demo --keep-running` leaves it up",
            highlight=False,
        )
    again = "".join(
        f" {flag} {value}"
        for flag, value, default in (
            ("--data-dir", data_dir, DEFAULT_DATA_DIR),
            ("--out", out, Path("nmbus-report")),
            ("--schema", schema, demo_lib.DEFAULT_SCHEMA),
        )
        if value != default and (flag != "--data-dir" or server is not None)
    )
    console.print(
        f"clean up: `nmbus demo --clean{again}` drops schema {schema}"
        + (" and deletes the embedded server's folder" if server is not None else "")
        + f" and {out}/",
        highlight=False,
    )


def _bus_outcome(result: demo_lib.BusResult) -> dict[str, Any]:
    snap = result.snapshot
    return {
        "orders": snap.orders,
        "seconds": round(result.seconds, 2),
        "payments": result.payments,
        "failed_attempts": snap.attempts_failed,
        "retried_attempts": snap.attempts_retried,
        "declined": snap.declined,
        "queues": {
            q.queue: {
                "processed": q.processed,
                "failed": q.failed,
                "retried": result.retried.get(q.queue, 0),
            }
            for q in snap.queues
        },
        "top_errors": [
            {"queue": queue, "error": error, "count": n} for queue, error, n in result.top_errors
        ],
    }


def _count(n: int, one: str, many: str) -> str:
    return f"{n:,} {one if n == 1 else many}"


def bus_summary(result: demo_lib.BusResult) -> str:
    """What the bus part did, in sentences that add up to the table above them (F included)."""
    snap = result.snapshot
    handled = sum(q.processed + q.failed for q in snap.queues)
    in_f = sum(q.failed for q in snap.queues)
    last = snap.attempts_failed - snap.attempts_retried
    rate = handled / result.seconds if result.seconds > 0 else 0.0
    attempts = _count(snap.attempts_failed, "handler attempt", "handler attempts")
    return (
        f"{_count(snap.orders, 'order', 'orders')} went through shop → billing → warehouse → "
        f"notifications in {result.seconds:.1f}s: {_count(handled, 'message', 'messages')} "
        f"handled ({rate:,.0f}/s). {attempts} failed and {snap.attempts_retried:,} of them "
        f"were retried. F holds {_count(in_f, 'message', 'messages')}: "
        f"{_count(snap.declined, 'declined card', 'declined cards')} (a PermanentError is "
        f"never retried) and {_count(last, 'message', 'messages')} whose last attempt failed. "
        f"{_count(result.payments, 'payment was', 'payments were')} recorded in the same "
        "transactions."
    )


def _print_bus(result: demo_lib.BusResult) -> None:
    console.print()
    console.print(bus_summary(result), highlight=False)
    if result.top_errors:
        console.print()
        console.print(
            Grid(
                "most frequent errors",
                [
                    Column("queue", key=True),
                    Column("error_info (first line)", wrap=True),
                    "rows",
                ],
                [[queue, error, n] for queue, error, n in result.top_errors[:6]],
            )
        )
