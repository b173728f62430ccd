"""CI's promise that a skip fails the run (NMBUS_TEST_STRICT=1, tests/conftest.py).

The Spark, JDBC, cluster and browser tests skip on a machine without those
tools; CI installs them all and relies on this to notice when one still skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "body",
    [
        'def test_a():\n    pytest.skip("no tool here")\n',
        'pytest.skip("no tool here", allow_module_level=True)\n',
        'pytest.importorskip("a_module_that_is_not_there")\n',
    ],
    ids=["in a test", "a whole module", "importorskip"],
)
def test_a_skip_fails_the_run_only_in_strict_mode(tmp_path: Path, body: str) -> None:
    test = tmp_path / "test_skips.py"
    test.write_text("import pytest\n\n" + body)

    def run(strict: bool) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "NMBUS_TEST_STRICT"}
        if strict:
            env["NMBUS_TEST_STRICT"] = "1"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        command += ["-p", "tests.conftest", str(test)]
        return subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )

    relaxed = run(strict=False)
    # A module skipped whole leaves no test run at all: pytest's "no tests" code.
    assert relaxed.returncode in (0, pytest.ExitCode.NO_TESTS_COLLECTED), relaxed.stderr
    assert "1 skipped" in relaxed.stdout
    strict = run(strict=True)
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "NMBUS_TEST_STRICT: skipped" in strict.stdout
