"""Cookbook files run as an operator runs them: psql, CSV out."""

from __future__ import annotations

import asyncio
import csv
import io
from pathlib import Path

from tests.procs import ROOT

COOKBOOK = ROOT / "sql" / "cookbook"


async def psql(dsn: str, file: str | Path, **variables: object) -> list[dict[str, str]]:
    """Run one cookbook file exactly as an operator would, and parse its CSV output."""
    args = ["psql", dsn, "-X", "-q", "--csv", "-v", "ON_ERROR_STOP=1"]
    for name, value in variables.items():
        args += ["-v", f"{name}={value}"]
    path = file if isinstance(file, Path) else COOKBOOK / file
    proc = await asyncio.create_subprocess_exec(
        *args, "-f", str(path), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert not err.strip(), err.decode()
    return list(csv.DictReader(io.StringIO(out.decode())))
