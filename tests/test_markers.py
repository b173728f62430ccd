"""The README's quick subset leaves out what it says: crash tests, Spark and the browser."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUICK = "not reliability and not spark and not browser"


def collected(marker: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", marker, "tests"],
        cwd=ROOT,
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_quick_subset_leaves_out_crash_spark_and_browser_tests() -> None:
    browser = collected("browser")
    assert browser and all(t.startswith("tests/test_dashboard.py::") for t in browser), browser
    reliability = collected("reliability")
    files = {t.split("::")[0] for t in reliability}
    assert "tests/reliability/test_routes_kill.py" in files  # marked by where it is
    assert all(f.startswith("tests/reliability/") for f in files), files
    quick = collected(QUICK)
    assert quick and not set(quick) & set(browser + reliability)
    assert not [t for t in quick if t.startswith(("tests/reliability/", "tests/test_stats.py"))]
    assert (
        "tests/test_markers.py::test_the_quick_subset_leaves_out_crash_spark_and_browser_tests"
        in quick
    )
