"""The SQL files: each statement written once, short files, no block nobody runs.

The adapter's SQL is in files by purpose (nmbus/postgres/sql/), the tools' in
nmbus/bench/queries.sql and nmbus/demo/queries.sql, and the repository's
benchmarks' (not shipped) in bench/queries.sql. A part two statements share (the
claim of claim and finish_claim) is a fragment they name, put in when the files
are loaded.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from bench import sql as repo_bench_sql
from nmbus.bench import sql as bench_sql
from nmbus.demo import sql as demo_sql
from nmbus.ports.store import SCHEMA_VERSION
from nmbus.postgres.sql import QUERIES, Block, load, read, render, render_segment

ROOT = Path(__file__).resolve().parent.parent
NMBUS = ROOT / "nmbus"
#: The Python that runs the SQL: nmbus's, and the repository's bench/.
CODE = (NMBUS, ROOT / "bench")
PACKAGES = ("nmbus.postgres.sql", "nmbus.bench", "nmbus.demo", "bench")
# A run of this many words found twice is a copy: a CTE, a table, a statement.
# A shorter clause (a column list, a WHERE of three lines) may repeat.
COPY_WORDS = 40
# One-line statements that may stand in two blocks: a tool makes its schema the
# way the library does, in a package of its own.
SHARED_ONE_LINERS = {"CREATE SCHEMA IF NOT EXISTS {schema}"}
_DOLLAR_QUOTE = re.compile(r"\$(?:[A-Za-z_]\w*)?\$")
_USE = re.compile(r"(?<!\{)\{([a-z_][a-z0-9_]*)(?:\(([^()]*)\))?\}(?!\})")


def blocks() -> dict[str, Block]:
    found: dict[str, Block] = {}
    for package in PACKAGES:
        found.update({f"{package}:{name}": block for name, block in read(package).items()})
    return found


def words(text: str) -> list[str]:
    return text.split()


def statements(text: str) -> Iterator[str]:
    """The statements of a block, split at semicolons outside quotes and $$ bodies."""
    start = i = 0
    while i < len(text):
        quote = _DOLLAR_QUOTE.match(text, i)
        if text[i] == "'":
            i = text.index("'", i + 1) + 1
            while text[i : i + 1] == "'":  # '' inside a literal
                i = text.index("'", i + 1) + 1
            continue
        if quote and not text[i - 1 : i].isalnum():
            i = text.index(quote[0], quote.end()) + len(quote[0])
            continue
        if text[i] == ";":
            yield " ".join(text[start:i].split())
            start = i + 1
        i += 1
    if text[start:].strip():
        yield " ".join(text[start:].split())


def used_by_blocks(all_blocks: dict[str, Block]) -> set[str]:
    """Names of blocks that another block puts in, or passes as a slot's value."""
    used: set[str] = set()
    for block in all_blocks.values():
        for name, args in _USE.findall(block.text):
            used.add(name)
            used.update(arg.partition("=>")[2].strip() for arg in args.split(","))
    return used


def names_in_python() -> tuple[set[str], list[re.Pattern[str]]]:
    """String constants of nmbus's (and bench/'s) Python code, and the f-strings given to a
    render() as patterns (render(f"ops_{verb}_failed", ...) runs ops_requeue_failed and
    ops_purge_failed)."""
    constants: set[str] = set()
    patterns: list[re.Pattern[str]] = []
    for path in (path for folder in CODE for path in folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                constants.add(node.value)
            elif (
                isinstance(node, ast.Call)
                and ast.unparse(node.func).endswith("render")
                and node.args
                and isinstance(node.args[0], ast.JoinedStr)
            ):
                parts = [
                    re.escape(part.value) if isinstance(part, ast.Constant) else r"\w+"
                    for part in node.args[0].values
                ]
                patterns.append(re.compile("".join(parts)))
    return constants, patterns


# -- the files -------------------------------------------------------------------------------


def test_the_adapter_s_sql_is_in_files_by_purpose() -> None:
    files = {block.path for block in read("nmbus.postgres.sql").values()}
    assert {"schema.sql", "runtime.sql", "operations.sql", "retention.sql"} <= files
    assert {"outbox.sql", "pubsub.sql", "sagas.sql", "segments.sql", "flow.sql"} <= files
    assert {"insert.sql", "claimcheck.sql"} <= files
    migrations = sorted(f for f in files if f.startswith("migrations/"))
    assert [m.split("/")[1][:3] for m in migrations] == [
        f"{v:03}" for v in range(2, SCHEMA_VERSION + 1)
    ]


def test_no_two_blocks_are_the_same_statement() -> None:
    by_text: dict[str, list[str]] = defaultdict(list)
    by_statement: dict[str, set[str]] = defaultdict(set)
    for name, block in blocks().items():
        by_text[" ".join(words(block.text))].append(name)
        for statement in statements(block.text):
            by_statement[statement].add(name)
    assert not [names for names in by_text.values() if len(names) > 1]
    twice = {
        statement: sorted(names)
        for statement, names in by_statement.items()
        if len(names) > 1 and statement not in SHARED_ONE_LINERS
    }
    assert not twice, twice


def test_no_text_is_written_twice() -> None:
    """No run of COPY_WORDS words appears twice, in two blocks or in one (the claim's CTE once)."""
    seen: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for name, block in blocks().items():
        text = words(block.text)
        for i in range(len(text) - COPY_WORDS + 1):
            seen[tuple(text[i : i + COPY_WORDS])].append(name)
    copies = {" ".join(run): names for run, names in seen.items() if len(names) > 1}
    assert not copies, next(iter(copies.items()))


def test_no_block_holds_a_fragment_s_text() -> None:
    """A fragment is named where it is needed, never pasted there by hand."""
    for package in PACKAGES:
        found = read(package)
        for fragment in used_by_blocks(found) & found.keys():
            text = " ".join(words(found[fragment].text))
            if len(text) < 40:  # a one-line condition: too short to be told from chance
                continue
            holders = [
                name
                for name, block in found.items()
                if name != fragment and text in " ".join(words(block.text))
            ]
            assert not holders, f"{holders} hold the text of {fragment}: name it instead"


def test_every_block_is_run_by_python_or_put_in_by_another() -> None:
    constants, patterns = names_in_python()
    all_blocks = blocks()
    put_in = used_by_blocks(all_blocks)
    dead = [
        key
        for key in all_blocks
        if (name := key.split(":")[1]) not in constants
        and name not in put_in
        and not any(p.fullmatch(name) for p in patterns)
    ]
    assert not dead, f"blocks nobody runs: {dead}"


def test_every_statement_renders_with_every_name_filled() -> None:
    for name in QUERIES:
        if "{segment}" in QUERIES[name]:
            text = render_segment(name, "s", "q", 3, datetime(2026, 1, 1, tzinfo=UTC))
        else:
            text = render(name, "s", "q")
        assert not re.search(r"\{:?[a-z_]+[(}]", text), (name, text)
    for tool in (bench_sql, demo_sql, repo_bench_sql):
        for name in tool.QUERIES:
            tool.render(name, "s", "q")


def test_the_three_claims_share_one_claim() -> None:
    # The fragment's text, put in three times, with each statement's own parameters.
    claim = render("claim", "s", "q")
    assert "AND id >= $4" in claim  # the ready floor
    for name, floor in (("finish_claim", "$9"), ("finish_claim_processed", "$5")):
        both = render(name, "s", "q")
        for line in claim.splitlines()[1:13]:
            assert line.strip().replace("$4", floor) in both, (name, line)
    assert "LIMIT $1" in claim and "LIMIT $7" in render("finish_claim", "s", "q")
    assert "LIMIT $3" in render("finish_claim_processed", "s", "q")


# -- the loader ------------------------------------------------------------------------------


MakePackage = Callable[[dict[str, str]], str]


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MakePackage:
    """A throw-away package of SQL files: package({"a.sql": "..."}) -> its name."""
    counter = iter(range(1000))

    def make(sql_files: dict[str, str]) -> str:
        name = f"sqlpkg_{tmp_path.name}_{next(counter)}".replace("-", "_")
        root = tmp_path / name
        for path, text in sql_files.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(textwrap.dedent(text))
        (root / "__init__.py").write_text("")
        return name

    monkeypatch.syspath_prepend(str(tmp_path))
    return make


def test_a_block_defined_twice_fails_the_load(package: MakePackage) -> None:
    name = package({"a.sql": "-- one --\nSELECT 1;\n", "sub/b.sql": "-- one --\nSELECT 2;\n"})
    with pytest.raises(ValueError, match=r"'one' is defined twice: in a\.sql and sub/b\.sql"):
        load(name)


def test_fragments_are_put_in_with_their_slots(package: MakePackage) -> None:
    name = package(
        {
            "a.sql": """\
            -- top --
            WITH {pick(limit => $3, extra => cond)}
            SELECT * FROM picked;

            -- plain --
            WITH {pick(limit => $1, extra => '')}
            SELECT 1;

            -- pick --
            -- Fragment: {:limit} rows, {:extra} on a line of its own.
            picked AS (
                SELECT id FROM {queue}
                WHERE true
                  {:extra}
                LIMIT {:limit}
            )

            -- cond --
            AND id > 0
            """,
        }
    )
    queries = load(name)
    assert queries["top"] == (
        "WITH picked AS (\n    SELECT id FROM {queue}\n    WHERE true\n      AND id > 0\n"
        "    LIMIT $3\n)\nSELECT * FROM picked;"
    )
    assert queries["plain"] == (
        "WITH picked AS (\n    SELECT id FROM {queue}\n    WHERE true\n    LIMIT $1\n)\nSELECT 1;"
    )
    assert "pick" not in queries  # a block with slots is only a part


def test_a_slot_passes_on_to_the_fragment_it_uses(package: MakePackage) -> None:
    name = package(
        {
            "a.sql": """\
            -- top --
            {outer(n => $2)};
            -- outer --
            SELECT {inner(m => {:n})}
            -- inner --
            {:m} + 1
            """,
        }
    )
    assert load(name)["top"] == "SELECT $2 + 1;"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("-- a --\nSELECT {nothing};\n", "names no block"),
        ("-- a --\n{b};\n-- b --\nSELECT {:x}\n", "has slots"),
        ("-- a --\n{b(x => 1, y => 2)};\n-- b --\nSELECT {:x}\n", "has slots"),
        ("-- a --\n{b(x)};\n-- b --\nSELECT {:x}\n", "bad argument"),
        ("-- a --\n{b};\n-- b --\n{a}\n", "circle"),
        ("-- queue --\nSELECT 1;\n", "takes the name of an identifier"),
    ],
)
def test_a_wrong_composition_fails_the_load(package: MakePackage, text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        load(package({"a.sql": text}))


def test_identifiers_and_doubled_braces_are_left_for_fill(package: MakePackage) -> None:
    name = package({"a.sql": "-- a --\nSELECT '{{\"n\": 1}}' FROM {queue} JOIN {schema}.x;\n"})
    assert load(name)["a"] == "SELECT '{{\"n\": 1}}' FROM {queue} JOIN {schema}.x;"
