"""The README's example runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_example_is_the_quickstart_sample() -> None:
    readme = (ROOT / "README.md").read_text()
    sample = (ROOT / "samples" / "quickstart.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    assert blocks, "README.md shows no Python example"
    assert blocks[0].strip() in sample


def test_quickstart_runs(dsn: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "samples.quickstart"],
        cwd=ROOT,
        env={**os.environ, "NMBUS_DSN": dsn},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "order 1 paid" in result.stdout
    assert "order 3 paid" in result.stdout
    assert "{'I': 0, 'R': 0, 'X': 4, 'F': 1}" in result.stdout


def test_request_reply_sample_runs(dsn: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "samples.request_reply"],
        cwd=ROOT,
        env={**os.environ, "NMBUS_DSN": dsn},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for line in ("apple: 0.50", "pear: 1.50", "fig: 3.60", "kiwi: 1.20", "plum: 2.00"):
        assert f"[storefront] {line}" in result.stdout
    assert "[pricing] quoting 1 x apple for acme" in result.stdout
    assert "[storefront] no reply from 'pricing' to pricing.GetQuote within 1s" in result.stdout
    # The storefront has no handlers, only replies to receive: nothing to warn about.
    assert "warning" not in (result.stdout + result.stderr).lower(), result.stdout


def test_delivery_sample_runs(dsn: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "samples.delivery"],
        cwd=ROOT,
        env={**os.environ, "NMBUS_DSN": dsn},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = result.stdout.splitlines()
    assert lines[0] == "audit of acct-2 (priority first)"
    acct1 = [line for line in lines if line.startswith("acct-1 entry")]
    assert acct1 == ["acct-1 entry 0: balance 100.00", "acct-1 entry 1: balance 70.00"]
    assert "acct-2 entry 1: balance 30.00" in lines
    assert "never printed" not in result.stdout
    assert any(line.startswith("failure port: ledger #1: Expired:") for line in lines)
    assert any("PermanentError: entry 2 of acct-1" in line for line in lines)
    assert any(line.startswith("tick heartbeat due at") for line in lines)
    assert lines[-1].startswith("ledger: {'I': 1, 'R': 0, 'X': ")
