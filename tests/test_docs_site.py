"""The documentation site (mkdocs.yml, docs/hooks.py): links and anchors hold, nothing is lost.

CI builds the real site with ``mkdocs build --strict``. These tests build a
small repository laid out like this one, with the same mkdocs.yml and hooks,
to show that the build fails on a broken link or anchor (into docs/ or out of
it), that the repository's files the pages link to are on the site, and that
a page the index does not list still gets into the navigation.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
pytest.importorskip("material", reason="the docs extra is not installed: pip install -e '.[docs]'")

ROOT = Path(__file__).resolve().parent.parent

INDEX = """# Index

## Start here

- [First page](first.md): where to begin.
- [Samples](../samples/README.md): runnable code.
"""
FIRST = """# First page

## 17:00 — clean up

See [the samples](../samples/README.md#the-shop), [the code](../lib/code.py),
[the folder](../lib/), [a heading](#1700--clean-up) and `[not a link](../nowhere.md)`.
"""
SAMPLES = """# Samples

## The shop

Back to [the first page](../docs/first.md#1700--clean-up); the [code](../lib/code.py).
"""


def _repository(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    shutil.copy(ROOT / "mkdocs.yml", repo / "mkdocs.yml")
    shutil.copy(ROOT / "docs" / "hooks.py", repo / "docs" / "hooks.py")
    (repo / "docs" / "README.md").write_text(INDEX)
    (repo / "docs" / "first.md").write_text(FIRST)
    (repo / "samples").mkdir()
    (repo / "samples" / "README.md").write_text(SAMPLES)
    (repo / "lib").mkdir()
    (repo / "lib" / "code.py").write_text("print('hello')\n")
    return repo


def _build(repo: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(repo / "mkdocs.yml")],
        cwd=repo,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_links_out_of_docs_reach_the_repository_files_on_the_site(tmp_path: Path) -> None:
    repo = _repository(tmp_path)
    built = _build(repo)
    assert built.returncode == 0, built.stderr
    site = repo / "site"
    first = (site / "first" / "index.html").read_text()
    assert 'href="../repo/samples/#the-shop"' in first
    assert 'href="../repo/lib/code.py"' in first and 'href="../repo/lib/"' in first
    assert (site / "repo" / "lib" / "code.py").read_text() == "print('hello')\n"
    listing = (site / "repo" / "lib" / "index.html").read_text()
    assert 'href="code.py"' in listing  # a folder is a page of its files
    samples = (site / "repo" / "samples" / "index.html").read_text()
    assert 'href="../../first/#1700--clean-up"' in samples  # back into docs/, anchor kept
    # GitHub's anchors: the same link works in the repository and on the site.
    assert 'id="1700--clean-up"' in first


@pytest.mark.parametrize(
    ("page", "old", "new", "said"),
    [
        ("docs/first.md", "#the-shop", "#no-such-heading", "does not contain an anchor"),
        ("docs/first.md", "../lib/code.py", "../lib/gone.py", "not found"),
        ("docs/first.md", "#1700--clean-up", "#1700-clean-up", "anchor"),
        ("samples/README.md", "../docs/first.md#", "../docs/second.md#", "not found"),
        ("samples/README.md", "#1700--clean-up", "#nowhere", "anchor"),
    ],
    ids=[
        "anchor out of docs",
        "file out of docs",
        "anchor in docs",
        "back into docs",
        "anchor back",
    ],
)
def test_a_broken_link_or_anchor_fails_the_build(
    tmp_path: Path, page: str, old: str, new: str, said: str
) -> None:
    repo = _repository(tmp_path)
    path = repo / page
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    built = _build(repo)
    assert built.returncode == 1, built.stderr
    assert "WARNING" in built.stderr and said in built.stderr, built.stderr


def test_a_page_the_index_does_not_list_is_still_in_the_navigation(tmp_path: Path) -> None:
    repo = _repository(tmp_path)
    (repo / "docs" / "later.md").write_text("# A page added later\n\nIt is [here](first.md).\n")
    built = _build(repo)
    assert built.returncode == 0, built.stderr
    home = (repo / "site" / "index.html").read_text()
    titles = re.findall(r'class="md-ellipsis">\s*([^<]+?)\s*<', home)
    assert "More" in titles and "A page added later" in titles, titles
    assert titles.index("First page") < titles.index("Samples") < titles.index("More")


def test_the_navigation_holds_every_page_of_docs_once() -> None:
    spec = importlib.util.spec_from_file_location("nmbus_docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)

    def pages(entries: list[object]) -> list[str]:
        found: list[str] = []
        for entry in entries:
            for value in entry.values() if isinstance(entry, dict) else [entry]:
                found += pages(value) if isinstance(value, list) else [str(value)]
        return found

    listed = pages(hooks.index_nav())
    assert len(listed) == len(set(listed)), listed
    every = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert every <= set(listed), every - set(listed)
