"""The documentation site's build hooks (``hooks:`` in mkdocs.yml).

The pages are written to be read in the repository as well, so they link to
files outside docs/ (``../samples/README.md``, ``../sql/schema.sql``,
``../nmbus/errors.py``, a folder such as ``../nmbus/postgres/sql/``). On the
site:

- every repository file a page links to is added under ``repo/``: Markdown as
  a page (whose own links are followed in turn), a folder as a page listing
  its files, anything else as a file served as it is;
- those links are rewritten to point there, so ``mkdocs build --strict``
  checks them, anchors included, like any link between pages; a link to a
  file that is not in the repository is left as written, and fails the build;
- the navigation is the index, docs/README.md: its sections and pages in its
  order. A page of docs/ that the index does not list comes last, under
  "More", so a new page is never left out of the site.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
INDEX = DOCS / "README.md"
# Where the repository's files that are not under docs/ go on the site.
REPO = "repo"

LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
CODE = re.compile(r"^(```|~~~).*?^\1[^\n]*$|`[^`\n]*`", re.MULTILINE | re.DOTALL)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:")


def _mask_code(text: str) -> str:
    """``text`` with every code span and block blanked out, of the same length and lines."""
    return CODE.sub(lambda m: re.sub(r"[^\n`]", "x", m.group(0)), text)


def _links(text: str) -> list[str]:
    """The targets of the links in ``text``, not counting those inside code."""
    return [text[m.start(2) : m.end(2)] for m in LINK.finditer(_mask_code(text))]


def _relink(text: str, change: Callable[[str], str]) -> str:
    """``text`` with each link's target (outside code) replaced by ``change(target)``."""
    parts, last = [], 0
    for m in LINK.finditer(_mask_code(text)):
        parts += [text[last : m.start(2)], change(text[m.start(2) : m.end(2)])]
        last = m.end(2)
    return "".join([*parts, text[last:]])


def site_uri(path: Path) -> str | None:
    """Where a file or folder of the repository is on the site; None outside the repository."""
    path = path.resolve()
    if path.is_dir():
        folder = site_uri(path / "index.md")
        return folder
    if path.is_relative_to(DOCS):
        return path.relative_to(DOCS).as_posix()
    if path.is_relative_to(ROOT):
        return f"{REPO}/{path.relative_to(ROOT).as_posix()}"
    return None


def source(src_uri: str) -> Path:
    """The repository file a page of the site comes from."""
    if src_uri.startswith(f"{REPO}/"):
        return ROOT / src_uri.removeprefix(f"{REPO}/")
    return DOCS / src_uri


def _outside_docs(target: str, page: Path) -> Path | None:
    """The repository file or folder outside docs/ that ``target`` names, if it is one."""
    if SCHEME.match(target) or target.startswith(("#", "/")):
        return None
    file_part = target.partition("#")[0]
    if not file_part:
        return None
    resolved = (page.parent / file_part).resolve()
    if not resolved.exists() or not resolved.is_relative_to(ROOT):
        return None  # not there: left as written, for the build to report
    if resolved.is_relative_to(DOCS) and page.resolve().is_relative_to(DOCS):
        return None  # between pages of docs/: the build resolves it itself
    return resolved


def _listing(folder: Path) -> str:
    """The page of a folder the pages link to: its files, each a link."""
    rel = folder.relative_to(ROOT).as_posix()
    lines = [f"# {rel}/", "", f"The files of `{rel}/` in the repository:", ""]
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith((".", "__")):
            continue
        name = entry.name + ("/" if entry.is_dir() else "")
        link = f"{entry.name}/index.md" if entry.is_dir() else entry.name
        lines.append(f"- [`{name}`]({link})")
    return "\n".join(lines) + "\n"


def on_files(files: Files, config: Any) -> Files:
    """Add the repository's files that the pages link to, following Markdown ones."""
    todo = [source(f.src_uri) for f in files.documentation_pages()]
    seen: set[Path] = set()
    while todo:
        page = todo.pop()
        if page.suffix != ".md" or page in seen:
            continue
        seen.add(page)
        text = _listing(page.parent) if page.name == "index.md" and not page.exists() else None
        for target in _links(text if text is not None else page.read_text(encoding="utf-8")):
            found = _outside_docs(target, page)
            if found is None:
                continue
            path = found / "index.md" if found.is_dir() else found
            uri = site_uri(found)
            if uri is None or files.get_file_from_path(uri) is not None:
                continue
            # Reached by links; the navigation lists only what the index lists.
            quiet = InclusionLevel.NOT_IN_NAV
            if found.is_dir():
                added = File.generated(config, uri, content=_listing(found), inclusion=quiet)
            else:
                added = File.generated(config, uri, abs_src_path=str(found), inclusion=quiet)
            files.append(added)
            todo.append(path)
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Point the links to repository files at their place on the site."""
    here = source(page.file.src_uri)
    if page.file.generated_by and not here.exists():  # a folder's listing
        here = here.parent / "index.md"
    at = os.path.dirname(page.file.src_uri)

    def rewrite(target: str) -> str:
        file_part, hashmark, anchor = target.partition("#")
        found = _outside_docs(target, here)
        if found is None:
            if here.resolve().is_relative_to(DOCS):
                return target
            # A page from outside docs/ that links into docs/: to that page's place.
            resolved = (here.parent / file_part).resolve() if file_part else None
            if resolved is None or not resolved.exists() or not resolved.is_relative_to(DOCS):
                return target
            found = resolved
        uri = site_uri(found)
        assert uri is not None
        return os.path.relpath(uri, at or ".") + hashmark + anchor

    return _relink(markdown, rewrite)


def index_nav() -> list[Any]:
    """The navigation: docs/README.md's sections and links in order, then any page it misses."""
    nav: list[Any] = [{"Home": "README.md"}]
    listed: set[str] = {"README.md"}
    section: list[Any] | None = None
    for line in INDEX.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"^##\s+(.*)", line)
        if heading:
            section = []
            nav.append({heading.group(1).strip(): section})
            continue
        item = re.match(r"^- \[([^\]]+)\]\(([^)\s]+)\)", line)
        if item is None or section is None:
            continue
        title, target = item.group(1).replace("`", ""), item.group(2)
        if "#" in target:
            continue  # a part of a page: the page itself is listed on its own
        uri = site_uri(DOCS / target)
        if uri is None or uri in listed:
            continue
        listed.add(uri)
        section.append({title: uri})
    more = [p.name for p in sorted(DOCS.glob("*.md")) if p.name not in listed]
    if more:
        nav.append({"More": more})
    return nav


def on_config(config: Any) -> Any:
    if not config.get("nav"):
        config["nav"] = index_nav()
    return config
