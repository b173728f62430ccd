"""The tests' own layout: helpers live in helper modules, and waiting is written once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import asyncpg
import pytest

from tests.waits import wait_until

TESTS = Path(__file__).resolve().parent
# A test module's dotted name: tests.test_x or tests.reliability.test_y.
TEST_MODULE = re.compile(r"^tests(?:\.\w+)*\.test_\w+$")
# The same import written inside a script a test hands to a subprocess.
IMPORT_IN_TEXT = re.compile(r"^\s*(?:from|import)\s+(tests(?:\.\w+)*\.test_\w+)", re.M)


def python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if ".venv" not in p.parts)


def imported(path: Path) -> set[str]:
    """The dotted names of what ``path`` imports, relative imports resolved."""
    package = list(path.relative_to(TESTS.parent).parent.parts)
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_no_test_module_imports_another_test_module() -> None:
    found = []
    for path in python_files():
        text = path.read_text()
        names = imported(path) | set(IMPORT_IN_TEXT.findall(text))
        rel = path.relative_to(TESTS.parent)
        found += [f"{rel}: {name}" for name in sorted(names) if TEST_MODULE.match(name)]
    assert not found, "move what they share into a helper module (tests/waits.py, ...):\n" + (
        "\n".join(found)
    )


def test_wait_until_is_defined_once() -> None:
    defined = [
        f"{path.relative_to(TESTS.parent)}:{node.lineno}"
        for path in python_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "wait_until"
    ]
    assert [place.split(":")[0] for place in defined] == ["tests/waits.py"], defined


async def test_wait_until_returns_the_value_that_held(db: asyncpg.Connection) -> None:
    calls: list[int] = []

    def counting() -> int:
        calls.append(1)
        return len(calls)

    assert await wait_until(counting, until=lambda n: n >= 3, interval=0.01) == 3
    assert await wait_until("SELECT $1::int + 1", 4, db=db) == 5


async def test_a_wait_that_times_out_names_what_it_awaited_and_the_last_value_seen(
    db: asyncpg.Connection,
) -> None:
    with pytest.raises(AssertionError, match=r"for the count; the last value seen: 2$"):
        await wait_until(lambda: 2, until=lambda n: n >= 3, timeout=0.2, what="the count")
    with pytest.raises(AssertionError, match=r"for SELECT 0; the last value seen: 0$"):
        await wait_until("SELECT 0", db=db, timeout=0.2)


async def test_an_error_in_the_check_ends_the_wait_at_once() -> None:
    def broken() -> bool:
        raise TimeoutError("the check's own")

    with pytest.raises(TimeoutError, match="the check's own"):
        await wait_until(broken, timeout=30)
