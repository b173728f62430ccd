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
    assert "4 kept, 0 broken" in done.stdout, done.stdout[-2000:]


@pytest.mark.parametrize(
    ("module", "imported", "said"),
    [
        ("envelopes.py", "nmbus.bus", "nmbus.envelopes is not allowed to import nmbus.bus"),
        ("consume/worker.py", "nmbus.bus", "nmbus.consume is not allowed to import nmbus.bus"),
        (
            "consume/batch.py",
            "nmbus.postgres",
            "nmbus.consume is not allowed to import nmbus.postgres",
        ),
        ("stats/job.py", "nmbus.settings", "nmbus.stats is not allowed to import nmbus.settings"),
    ],
)
def test_a_module_importing_one_it_must_not_breaks_a_contract(
    tmp_path: Path, module: str, imported: str, said: str
) -> None:
    """The contracts can fail: the same check on a copy where ``module`` imports ``imported``."""
    copy = tmp_path / "tree"
    shutil.copytree(PACKAGE, copy / "nmbus", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    changed = copy / "nmbus" / module
    changed.write_text(changed.read_text() + f"\nimport {imported}  # noqa\n")
    done = subprocess.run(
        [lint_imports(), "--no-cache"],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(copy), "PATH": str(Path(sys.executable).parent)},
    )
    assert done.returncode != 0
    assert said in " ".join(done.stdout.split()), done.stdout[-2000:]
