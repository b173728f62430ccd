"""Processes the tests start, read line by line, and kill for real."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What a JVM running Spark prints on its own: log4j levels, its banner, Java's
# warnings. nmbus report and nmbus demo send it to a log file, not the terminal.
JVM_NOISE = re.compile(r"\b(WARN|INFO|ERROR)\b|log4j|SLF4J|Spark's default|^WARNING: ", re.M)


class Proc:
    """``python -m <module> <args>`` whose stdout lines we can wait for."""

    def __init__(self, module: str, *args: str, env: dict[str, str] | None = None) -> None:
        """``env``: variables set for this process alone, over the tests' own."""
        self.popen = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            env=None if env is None else {**os.environ, **env},
        )
        self.lines: list[str] = []

    async def wait_for(self, prefix: str, timeout: float = 30.0) -> str:
        assert self.popen.stdout is not None
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            while True:
                line = await loop.run_in_executor(None, self.popen.stdout.readline)
                if not line:
                    raise AssertionError(f"process exited before printing {prefix!r}")
                self.lines.append(line.strip())
                if line.startswith(prefix):
                    return line.strip()

    def kill(self) -> None:
        """SIGKILL (if still running) and collect what it printed."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)
        if self.popen.stdout is not None and not self.popen.stdout.closed:
            self.lines.extend(x.strip() for x in self.popen.stdout.read().splitlines())
            self.popen.stdout.close()
