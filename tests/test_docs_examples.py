"""The examples of docs/middleware.md and of docs/testing.md's levels 1 and 2 run as
written: each Python block is a test module of its own, run by pytest in a folder of
its own (no database: they use HandlerTest and SagaScenario)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks() -> list[tuple[str, str]]:
    found = []
    for page in ("middleware.md", "testing.md"):
        text = (ROOT / "docs" / page).read_text(encoding="utf-8")
        for n, block in enumerate(BLOCK.findall(text), 1):
            # testing.md's whole-bus level runs in tests/test_pytest_plugin.py.
            if page == "middleware.md" or "HandlerTest" in block or "SagaScenario" in block:
                found.append((f"{page}#{n}", block))
    return found


def test_the_pages_have_their_examples() -> None:
    names = [name for name, _ in blocks()]
    assert names == ["middleware.md#1", "testing.md#1", "testing.md#2"]


@pytest.mark.parametrize(("name", "code"), blocks(), ids=[n for n, _ in blocks()])
def test_the_example_runs(tmp_path: Path, name: str, code: str) -> None:
    (tmp_path / "test_example.py").write_text(code, encoding="utf-8")
    done = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:nmbus",
            "-o", "asyncio_mode=auto", "-o", "asyncio_default_fixture_loop_scope=function",
            "-W", "error", "test_example.py",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    tests = len(re.findall(r"^async def test_|^def test_", code, re.MULTILINE))
    assert tests, f"{name} holds no test"
    assert done.returncode == 0 and f"{tests} passed" in done.stdout, done.stdout + done.stderr
