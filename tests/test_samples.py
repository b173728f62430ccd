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


def run_sample(name: str, dsn: str) -> subprocess.CompletedProcess[str]:
    """``python -m samples.<name>`` against ``dsn``, as its docstring says to run it."""
    return subprocess.run(
        [sys.executable, "-m", f"samples.{name}"],
        cwd=ROOT,
        env={**os.environ, "NMBUS_DSN": dsn},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


def test_quickstart_runs(dsn: str) -> None:
    result = run_sample("quickstart", dsn)
    assert "order 1 paid" in result.stdout
    assert "order 3 paid" in result.stdout
    assert "{'I': 0, 'R': 0, 'X': 4, 'F': 1}" in result.stdout


def test_request_reply_sample_runs(dsn: str) -> None:
    result = run_sample("request_reply", dsn)
    for line in ("apple: 0.50", "pear: 1.50", "fig: 3.60", "kiwi: 1.20", "plum: 2.00"):
        assert f"[storefront] {line}" in result.stdout
    assert "[pricing] quoting 1 x apple for acme" in result.stdout
    assert "[storefront] no reply from 'pricing' to pricing.GetQuote within 1s" in result.stdout
    # The storefront has no handlers, only replies to receive: nothing to warn about,
    # and the sample's output is its own lines, no log line of the library's.
    assert "warning" not in (result.stdout + result.stderr).lower(), result.stdout
    assert all(line.startswith("[") for line in result.stdout.splitlines()), result.stdout
    assert not re.search(r"\[(debug|info) *\]", result.stdout + result.stderr), result.stdout


def test_delivery_sample_runs(dsn: str) -> None:
    result = run_sample("delivery", dsn)
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
    # Every queue is created before it is sent to: no warning that a send created one.
    assert "queue_created_by_send" not in result.stdout + result.stderr


def test_flow_control_sample_runs(dsn: str) -> None:
    result = run_sample("flow_control", dsn)
    lines = result.stdout.splitlines()
    assert lines[0] == "cancelled before it started: 1"
    charged = re.fullmatch(
        r"charged 59 orders in ([\d.]+) s; at most (\d+) in any second", lines[1]
    )
    assert charged is not None, lines[1]
    assert float(charged[1]) >= 2.0 and int(charged[2]) <= 20  # 59 at 20 a second
    assert lines[2] == "exports running at once per tenant: {'big': 1, 'small': 1}"
    behind = re.fullmatch(r"the small tenant's export waited for (\d+) of the big .*", lines[3])
    assert behind is not None and int(behind[1]) < 10, lines[3]
