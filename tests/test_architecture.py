"""The package's shape: arrows that point down.

Files are cut by concept, not by a line count; the layers are import-linter
contracts in pyproject.toml (``[tool.importlinter]``), checked here and by
``lint-imports`` in CI.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nmbus"


def lint_imports() -> str:
    found = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("lint-imports is not installed: pip install -e '.[dev]' installs it")
    return found


def test_the_import_contracts_are_kept() -> None:
    done = subprocess.run(
        [lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "3 kept, 0 broken" in done.stdout, done.stdout[-2000:]


def test_a_module_importing_one_above_it_breaks_the_contract(tmp_path: Path) -> None:
    """The contract can fail: the same check on a copy where envelopes imports the Bus."""
    copy = tmp_path / "tree"
    shutil.copytree(PACKAGE, copy / "nmbus", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    envelopes = copy / "nmbus" / "envelopes.py"
    envelopes.write_text(envelopes.read_text() + "\nimport nmbus.bus  # noqa\n")
    done = subprocess.run(
        [lint_imports(), "--no-cache"],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(copy), "PATH": str(Path(sys.executable).parent)},
    )
    assert done.returncode != 0
    assert "nmbus.envelopes is not allowed to import nmbus.bus" in done.stdout, done.stdout[-2000:]
