"""``python -m bench.claimcheck``: send and handle large bodies, with and without the claim check.

For each case (a store and a body size), in a scratch schema of its own
(dropped at the end): one Bus sends ``count`` messages one after the other (each
its own round trip and commit), timed; then a Bus with one worker loop
handles them (the handler reads the body's length), timed from its start to
the last message handled. Prints msg/s and MiB/s (of body) of both, per run.

Cases: ``table`` (the default store: the schema's payloads table), ``file``
(a store of files in a temporary folder, ``file://``), ``none`` (no claim
check: ``max_message_bytes`` raised to hold the body in its row; only for
bodies up to 64 MiB).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import tempfile
import time
from typing import Any

import structlog

from nmbus.bench.scratch import Scratch
from nmbus.bus import Bus
from nmbus.context import Context
from nmbus.messages import Message

MiB = 1024 * 1024


class Payload(Message, type_name="nmbus.bench.Payload"):
    data: str


def settings_of(case: str, size: int, folder: str) -> dict[str, Any]:
    if case == "table":
        return {"claim_check_bytes": 256_000}
    if case == "file":
        return {"claim_check_bytes": 256_000, "claim_check_store": f"file://{folder}"}
    return {"max_message_bytes": size + MiB}


async def one_run(dsn: str, case: str, size: int, count: int) -> dict[str, Any]:
    body = os.urandom(size // 2).hex()
    with tempfile.TemporaryDirectory(prefix="nmbus-bench-cc-") as folder:
        async with Scratch(dsn) as scratch:
            extra = settings_of(case, size, folder)
            common = {"dsn": dsn, "schema_name": scratch.schema, **extra}
            async with Bus("bench_cc", concurrency=0, **common) as sender:
                started = time.perf_counter()
                for _ in range(count):
                    await sender.send(Payload(data=body), to="bench_cc")
                sent = time.perf_counter() - started
            done = asyncio.Event()
            handled = 0
            worker = Bus("bench_cc", concurrency=1, **common)

            @worker.handler
            async def handle(msg: Payload, ctx: Context) -> None:
                nonlocal handled
                if len(msg.data) != size:
                    raise RuntimeError(f"got {len(msg.data)} characters, sent {size}")
                handled += 1
                if handled == count:
                    done.set()

            started = time.perf_counter()
            async with worker:
                await asyncio.wait_for(done.wait(), timeout=600)
                took = time.perf_counter() - started
    mib = size * count / MiB
    return {
        "case": case,
        "body_mib": size / MiB,
        "messages": count,
        "send_msg_s": round(count / sent, 2),
        "send_mib_s": round(mib / sent, 1),
        "handle_msg_s": round(count / took, 2),
        "handle_mib_s": round(mib / took, 1),
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for _ in range(args.repeat):
        for case in args.cases:
            for size_mib in args.sizes:
                size = int(size_mib * MiB)
                count = max(1, int(args.mib / size_mib))
                result = await one_run(args.dsn, case, size, count)
                print(json.dumps(result) if args.json else _line(result), flush=True)
                results.append(result)
    return results


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['case']:5} {r['body_mib']:g} MiB x {r['messages']}: "
        f"send {r['send_msg_s']} msg/s {r['send_mib_s']} MiB/s, "
        f"handle {r['handle_msg_s']} msg/s {r['handle_mib_s']} MiB/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.claimcheck", description=__doc__)
    parser.add_argument("--dsn", default=os.environ.get("NMBUS_DSN"), required=False)
    parser.add_argument("--cases", nargs="+", default=["table", "file", "none"])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1.0, 16.0], help="MiB")
    parser.add_argument("--mib", type=float, default=64.0, help="MiB of bodies per case")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn or NMBUS_DSN is needed")
    # The buses' own info lines (started, stopped) would bury the figures.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
