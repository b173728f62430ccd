"""``python -m bench peers``: graphile-worker (Node.js) on the same server, in the same sitting.

graphile-worker is not a Python package: the bench runs ``graphile_drain.js``
(beside this module) with the machine's ``node``, and graphile-worker from a
``node_modules`` folder installed beforehand; nothing is downloaded here. The
folder is ``$NMBUS_GRAPHILE_MODULES``, else ``~/.cache/graphile/node_modules``
(what :data:`INSTALL_HINT` makes). Its jobs go in a schema of the bench's own
(the scratch schema's name with ``_gw``), dropped afterwards, so nothing of
the database pointed at is touched.

Two settings: ``default`` (``concurrentJobs: 1``, the library's default) and
``tuned`` (the settings of graphile-worker's own performance page:
``concurrentJobs: 24``, ``maxPoolSize: 25``, ``localQueue: {size: 500}``,
batch delays 0). The DSN goes to the script in its environment, never in its
arguments (which ``ps`` shows).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from pathlib import Path

from nmbus.bench.scratch import BenchOptions, Scratch
from nmbus.postgres.sql import quote_ident

SCRIPT = Path(__file__).with_name("graphile_drain.js")
#: The version measured beside nmbus (docs/performance.md).
VERSION = "0.17.3"
INSTALL_HINT = (
    f"mkdir -p ~/.cache/graphile && cd ~/.cache/graphile && npm install graphile-worker@{VERSION}"
    " (or set NMBUS_GRAPHILE_MODULES to the node_modules folder that holds it)"
)
#: The most jobs the ``default`` setting drains: one job at a time, about 1,700 a
#: second here, would take half a minute for 50,000.
DEFAULT_MODE_JOBS = 5_000
_LINE = re.compile(r"graphile drain=(\d+) mode=(\w+) jobs=(\d+) seconds=([\d.]+) left=(\d+)")


def modules() -> Path | None:
    """The node_modules folder that holds graphile-worker, if there is one."""
    given = os.environ.get("NMBUS_GRAPHILE_MODULES")
    folder = Path(given) if given else Path.home() / ".cache" / "graphile" / "node_modules"
    return folder if (folder / "graphile-worker" / "package.json").is_file() else None


def missing() -> str | None:
    """Why graphile-worker cannot run here (None: it can)."""
    if shutil.which("node") is None:
        return "node is not installed: graphile-worker needs Node.js 20 or newer"
    if modules() is None:
        return f"graphile-worker is not installed: {INSTALL_HINT}"
    return None


def version() -> str:
    found = modules()
    if found is None:
        return "-"
    text = (found / "graphile-worker" / "package.json").read_text()
    matched = re.search(r'"version"\s*:\s*"([^"]+)"', text)
    return matched[1] if matched else "?"


async def measure_graphile(
    options: BenchOptions, scratch: Scratch, mode: str, timeout: float = 600.0
) -> tuple[float, int]:
    """Jobs per second of graphile-worker draining no-op jobs in ``mode``; and how many."""
    found, node = modules(), shutil.which("node")
    if found is None or node is None:
        raise RuntimeError(missing())
    jobs = options.messages if mode == "tuned" else min(options.messages, DEFAULT_MODE_JOBS)
    schema = f"{scratch.schema}_gw"
    env = {**os.environ, "NODE_PATH": str(found), "NMBUS_BENCH_DSN": options.dsn}
    # The script pre-loads and drains in one go: no checkpoint can go between, as
    # nmbus's drain has one. This one at least flushes what the runs before it dirtied.
    await scratch.checkpoint()
    proc = await asyncio.create_subprocess_exec(
        node,
        str(SCRIPT),
        schema,
        str(jobs),
        mode,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise RuntimeError(f"graphile-worker ({mode}) did not finish in {timeout:.0f} s") from None
    finally:
        await scratch.c.execute(f"DROP SCHEMA IF EXISTS {quote_ident(schema)} CASCADE")
    matched = _LINE.search(out.decode())
    if proc.returncode != 0 or matched is None:
        said = err.decode().strip().splitlines()
        why = said[-1] if said else f"exit code {proc.returncode}, nothing on stderr"
        raise RuntimeError(f"graphile-worker ({mode}) failed: {why}")
    rate, _, done, _, left = matched.groups()
    if int(done) != jobs or int(left):
        raise RuntimeError(f"graphile-worker ({mode}) drained {done} of {jobs}; {left} left")
    return float(rate), jobs
