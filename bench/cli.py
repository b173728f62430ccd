"""``python -m bench``: every mode, nmbus bench's and the repository's own, in one table.

The options of nmbus bench, the same options the modes here had under it, and
the same one-line errors (:class:`nmbus.cli._group.NmbusCommand`).
"""

from __future__ import annotations

from typing import Annotated

import typer

from nmbus.cli._common import LogFormat, LogLevel, configure_logging
from nmbus.cli._group import NmbusCommand
from nmbus.cli.bench import (
    DEFAULT_CONCURRENCY,
    AsJson,
    BaselineMessages,
    BatchSize,
    Concurrency,
    Dsn,
    Processes,
    Rate,
    Repeat,
    Sagas,
    Seconds,
    UnconfiguredLogging,
    Warmup,
    choose,
    measure,
)

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

MODES_HELP = (
    "ceiling, peers, drain, transactional, latency, fanout, scaling, xrows, saga, delivery, "
    "routed, pooler, reply, retention, flow, burst, or all (ceiling, peers, drain, "
    "transactional, latency and fanout)"
)


@app.command(cls=NmbusCommand)
def bench(
    modes: Annotated[list[str] | None, typer.Argument(help=MODES_HELP, show_default=False)] = None,
    dsn: Dsn = None,
    messages: Annotated[
        int,
        typer.Option(
            "--messages",
            "-n",
            min=1,
            help="messages pre-loaded and drained per run (every mode but latency and fanout)",
        ),
    ] = 50_000,
    batch_size: BatchSize = None,
    concurrency: Concurrency = DEFAULT_CONCURRENCY,
    processes: Processes = 1,
    sagas: Sagas = 3,
    baseline_messages: BaselineMessages = 5_000,
    rate: Rate = 200.0,
    seconds: Seconds = 10.0,
    warmup: Warmup = 1.0,
    subscribers: Annotated[int, typer.Option(min=1, help="fanout: subscriber queues")] = 3,
    publishers: Annotated[int, typer.Option(min=1, help="fanout: concurrent publishers")] = 8,
    fanout_messages: Annotated[int, typer.Option(min=1, help="fanout: messages")] = 10_000,
    fanout_batch: Annotated[
        int, typer.Option(min=1, help="fanout: messages per publish_many call")
    ] = 500,
    x_rows: Annotated[
        int, typer.Option(min=0, help="xrows, retention: processed rows pre-loaded")
    ] = 5_000_000,
    segments: Annotated[
        int, typer.Option(min=1, max=10_000, help="xrows, retention: segments the X rows fill")
    ] = 30,
    sequences: Annotated[int, typer.Option(min=1, help="delivery: sequences")] = 50,
    sequence_members: Annotated[
        int, typer.Option(min=1, help="delivery: members of each sequence")
    ] = 1_000,
    repeat: Repeat = 1,
    peer: Annotated[
        list[str] | None,
        typer.Option(
            help="peers: a peer to measure, pgqueuer or graphile-worker (repeatable; unset: both)",
            show_default=False,
        ),
    ] = None,
    unconfigured_logging: UnconfiguredLogging = False,
    as_json: AsJson = False,
) -> None:
    """Measure nmbus, and its peers, on scratch schemas it creates and drops."""
    from bench.modes import ALL_MODES, MODES, PEERS, Options, run

    # As nmbus's root command leaves it for nmbus bench: warnings and errors, to stderr.
    configure_logging(LogLevel.warning, LogFormat.console)
    if not dsn:
        raise typer.BadParameter("give --dsn or set NMBUS_DSN", param_hint="--dsn")
    chosen = choose(modes, MODES, ALL_MODES, MODES_HELP)
    peers = tuple(dict.fromkeys(peer or PEERS))
    for name in peers:
        if name not in PEERS:
            raise typer.BadParameter(
                f"unknown peer {name!r}; choose from {', '.join(PEERS)}", param_hint="--peer"
            )
    options = Options(
        dsn=dsn,
        messages=messages,
        batch_size=batch_size,
        concurrency=concurrency,
        baseline_messages=baseline_messages,
        rate=rate,
        seconds=seconds,
        warmup=warmup,
        subscribers=subscribers,
        publishers=publishers,
        fanout_messages=fanout_messages,
        fanout_batch=fanout_batch,
        x_rows=x_rows,
        segments=segments,
        sequences=sequences,
        sequence_members=sequence_members,
        repeat=repeat,
        processes=processes,
        sagas=sagas,
        peers=peers,
    )
    measure(
        lambda progress: run(chosen, options, progress),
        title="python -m bench",
        as_json=as_json,
        unconfigured_logging=unconfigured_logging,
    )
