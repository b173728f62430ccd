"""``nmbus asyncapi``: the contract document of every sample endpoint, as the AsyncAPI
project's own parser reads it, and what each document says.

The command runs here with no database at all: NMBUS_DSN unset, and the routes
sample's second database on a port where nothing listens. A command that
connected would fail.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, Field

from nmbus import Bus, Context, Message
from nmbus.bus.asyncapi import ASYNCAPI_VERSION, HEADERS_SCHEMA, document
from nmbus.errors import ConfigurationError, InvalidQueueName
from nmbus.telemetry.tracing import TRACEPARENT, TRACESTATE
from nmbus.testing import MemoryStore
from tests import asyncapi_parser

# One `nmbus asyncapi` process per sample endpoint (15 or so), then node: seconds on an
# idle machine, more on a loaded one.
pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"
# Sample modules that are no endpoint: packages, the shop's helpers and launcher,
# and a benchmark whose buses live in a scratch schema for one run.
NOT_ENDPOINTS = {
    "samples",
    "samples.shop",
    "samples.shop._service",
    "samples.shop.all",
    "samples.bench_publish",
}
# Where nothing listens: a command that tried to connect would fail.
NOWHERE = "postgresql://nobody:s3cret@127.0.0.1:1/nothing"
# What the parser says of every 3.0.0 document: 3.1.0 exists. The same document
# labelled 3.1.0 is checked too, and there it must say nothing at all.
NEWER_VERSION_NOTE = "asyncapi-latest-version"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_bus(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Bus"


def _sample_buses() -> dict[str, tuple[list[str], int]]:
    """Each sample module: the names of its module-level Buses, and how many Bus() it calls."""
    found = {}
    for path in sorted(SAMPLES.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        named = [
            target.id
            for stmt in tree.body
            if isinstance(stmt, ast.Assign) and _is_bus(stmt.value)
            for target in stmt.targets
            if isinstance(target, ast.Name)
        ]
        found[_module(path)] = (named, sum(_is_bus(node) for node in ast.walk(tree)))
    return found


def sample_endpoints() -> list[str]:
    return [
        f"{module}:{name}"
        for module, (named, _) in _sample_buses().items()
        if module not in NOT_ENDPOINTS
        for name in named
    ]


def asyncapi(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m nmbus asyncapi ARGS`` (this checkout's code), without NMBUS_DSN."""
    base = {k: v for k, v in os.environ.items() if k != "NMBUS_DSN"}
    return subprocess.run(
        [sys.executable, "-m", "nmbus", "asyncapi", *args],
        cwd=ROOT,
        env={**base, "NMBUS_DB_B": NOWHERE, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def documents(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The document of every sample endpoint, each in a file, by MODULE:BUS."""
    folder = tmp_path_factory.mktemp("asyncapi")
    found = {}
    targets = sample_endpoints()
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(asyncapi, targets))
    for target, result in zip(targets, results, strict=True):
        assert result.returncode == 0, f"{target}: {result.stderr}"
        assert result.stderr == "", result.stderr
        path = folder / f"{target.replace(':', '.')}.json"
        path.write_text(result.stdout, encoding="utf-8")
        found[target] = path
    return found


def load(documents: dict[str, Path], target: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(documents[target].read_text(encoding="utf-8"))
    return data


def parse_strictly(files: list[Path]) -> None:
    """Every file parses with no diagnostic of any severity, but for the note that a newer
    AsyncAPI exists; labelled 3.1.0 (the newest the parser knows), with none at all."""
    why = asyncapi_parser.missing()
    if why is not None:
        pytest.skip(why)  # CI installs it (.ci/run): there a skip fails the run
    relabelled = []
    for path in files:
        data = json.loads(path.read_text(encoding="utf-8"))
        assert data["asyncapi"] == ASYNCAPI_VERSION == "3.0.0"
        newer = path.with_name(f"{path.stem}.3.1.0.json")
        newer.write_text(json.dumps({**data, "asyncapi": "3.1.0"}), encoding="utf-8")
        relabelled.append(newer)
    said = asyncapi_parser.parse(files + relabelled)
    assert set(said) == set(files + relabelled)
    for path in files:
        assert said[path]["parsed"], said[path]["diagnostics"]
        codes = [d["code"] for d in said[path]["diagnostics"]]
        assert codes == [NEWER_VERSION_NOTE], (path.name, said[path]["diagnostics"])
    for path in relabelled:
        assert said[path]["parsed"] and said[path]["diagnostics"] == [], (path.name, said[path])


# -- every sample endpoint --------------------------------------------------------------


def test_every_sample_endpoint_is_a_bus_at_module_level() -> None:
    # So that `nmbus asyncapi module:bus` (and `nmbus worker`) reach each one, and the
    # test below validates every endpoint the samples have, none left inside a function.
    for module, (named, calls) in _sample_buses().items():
        if module in NOT_ENDPOINTS:
            continue
        assert named, f"{module} builds no Bus at module level"
        assert len(named) == calls, f"{module}: {calls} Bus() calls, {named} at module level"
    assert len(sample_endpoints()) >= 14


def test_the_document_of_every_sample_endpoint_passes_the_asyncapi_parser(
    documents: dict[str, Path],
) -> None:
    assert set(documents) == set(sample_endpoints())
    parse_strictly(list(documents.values()))


def test_a_document_the_parser_refuses_fails_the_check(tmp_path: Path) -> None:
    # The check above can fail: a document with a reference to nowhere does.
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {
                "asyncapi": "3.0.0",
                "info": {"title": "x", "version": "1"},
                "operations": {"o": {"action": "receive", "channel": {"$ref": "#/channels/x"}}},
            }
        )
    )
    with pytest.raises(AssertionError):
        parse_strictly([bad])


# -- what a document says ---------------------------------------------------------------


def test_billing_receives_what_it_subscribes_to_and_publishes_what_it_declares(
    documents: dict[str, Path],
) -> None:
    doc = load(documents, "samples.shop.billing:bus")
    assert doc["info"]["title"] == "billing" and doc["info"]["version"] == "1.0.0"
    assert doc["channels"]["queue.billing"]["address"] == "billing"
    assert "nmbus.billing" in doc["channels"]["queue.billing"]["description"]
    # Published messages have no single address: each subscriber's copy is in its queue.
    assert doc["channels"]["published.orders"]["address"] is None
    ops = doc["operations"]
    assert set(ops) == {
        "receive.shop.OrderPlaced",
        "subscribe.orders.shop.OrderPlaced",
        "publish.shop.PaymentTaken",
    }
    assert ops["receive.shop.OrderPlaced"]["action"] == "receive"
    assert ops["receive.shop.OrderPlaced"]["channel"] == {"$ref": "#/channels/queue.billing"}
    assert ops["subscribe.orders.shop.OrderPlaced"]["channel"] == {
        "$ref": "#/channels/published.orders"
    }
    assert (
        "expires 3600 s after the last renewal"
        in ops["subscribe.orders.shop.OrderPlaced"]["description"]
    )
    publish = ops["publish.shop.PaymentTaken"]
    assert publish["action"] == "send"
    assert publish["channel"] == {"$ref": "#/channels/published.billing"}
    assert publish["messages"] == [
        {"$ref": "#/channels/published.billing/messages/shop.PaymentTaken"}
    ]
    message = doc["components"]["messages"]["shop.OrderPlaced"]
    assert message["name"] == message["x-nmbus-type-name"] == "shop.OrderPlaced"
    assert message["x-nmbus-version"] == 1
    assert message["payload"] == {"$ref": "#/components/schemas/OrderPlaced"}
    # Billing's own view of the event: the fields its class has, as pydantic says.
    schema = doc["components"]["schemas"]["OrderPlaced"]
    assert schema["required"] == ["order_id", "amount_cents"]
    assert {k: v["type"] for k, v in schema["properties"].items()} == {
        "order_id": "integer",
        "amount_cents": "integer",
    }


def test_each_message_carries_every_header_nmbus_sets(documents: dict[str, Path]) -> None:
    # Every header name the package defines (NAME_HEADER = "..." in any module), and the
    # trace context's.
    constants = {TRACEPARENT, TRACESTATE}
    for path in (ROOT / "nmbus").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
                and any(isinstance(t, ast.Name) and t.id.endswith("_HEADER") for t in node.targets)
            ):
                constants.add(node.value.value)
    assert {"nmbus-type-chain", "nmbus-group", "nmbus-failed-error"} <= constants
    for target in documents:
        doc = load(documents, target)
        headers = doc["components"]["schemas"][HEADERS_SCHEMA]
        assert set(headers["properties"]) == constants, target
        assert headers["additionalProperties"] == {"type": "string"}  # the application's own
        for message in doc["components"]["messages"].values():
            assert message["headers"] == {"$ref": f"#/components/schemas/{HEADERS_SCHEMA}"}


def test_a_saga_endpoint_lists_its_subscriptions_and_its_timeout(
    documents: dict[str, Path],
) -> None:
    doc = load(documents, "samples.shop.fulfilment:bus")
    ops = doc["operations"]
    assert sorted(k for k in ops if k.startswith("subscribe.")) == [
        "subscribe.billing.shop.PaymentTaken",
        "subscribe.orders.shop.OrderPlaced",
        "subscribe.shipping.shop.OrderShipped",
    ]
    # Its saga's timeout goes to its own queue: sent there, and received there.
    assert ops["send.fulfilment.shop.PaymentOverdue"]["channel"] == {
        "$ref": "#/channels/queue.fulfilment"
    }
    assert ops["receive.shop.PaymentOverdue"]["channel"] == {"$ref": "#/channels/queue.fulfilment"}
    assert doc["components"]["messages"]["shop.PaymentOverdue"]["summary"].startswith(
        "The saga's timeout"
    )


def test_a_sender_names_the_queue_it_sends_to(documents: dict[str, Path]) -> None:
    doc = load(documents, "samples.request_reply:storefront")
    assert doc["channels"]["queue.pricing"]["address"] == "pricing"
    assert doc["operations"]["send.pricing.pricing.GetQuote"]["action"] == "send"
    # The storefront handles nothing: its workers only take the replies to its requests.
    assert not any(op["action"] == "receive" for op in doc["operations"].values())


def test_a_failure_port_a_periodic_tick_and_a_handler_of_every_type(
    documents: dict[str, Path],
) -> None:
    ledger = load(documents, "samples.delivery:ledger")
    assert "queue errors, its failure port" in ledger["info"]["description"]
    assert "receive.nmbus.Tick" in ledger["operations"]
    tick = ledger["components"]["schemas"]["Tick"]
    assert tick["properties"]["scheduled_at"]["format"] == "date-time"
    errors = load(documents, "samples.delivery:errors")
    assert errors["operations"]["receive.Message"]["summary"] == "Handle Message"


def test_routed_endpoints_are_described_without_their_databases(
    documents: dict[str, Path],
) -> None:
    orders = load(documents, "samples.routes:orders")
    assert set(orders["operations"]) == {
        "receive.shop.Charged",
        "publish.shop.OrderPlaced",
        "send.billing.shop.Charge",
    }
    for target in documents:
        text = documents[target].read_text(encoding="utf-8")
        assert "s3cret" not in text and "127.0.0.1" not in text and "invalid" not in text


# -- the command --------------------------------------------------------------------------


def test_it_needs_no_database_and_prints_no_secret_of_its_dsn() -> None:
    result = asyncapi("samples.quickstart:bus", NMBUS_DSN=NOWHERE)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["info"]["title"] == "billing"
    assert "s3cret" not in result.stdout + result.stderr
    versioned = asyncapi("samples.quickstart:bus", "--api-version", "2.4.1")
    assert json.loads(versioned.stdout)["info"]["version"] == "2.4.1"


@pytest.mark.parametrize(
    ("target", "code", "said"),
    [
        ("samples.quickstart", 2, "expected module:attribute"),
        ("samples.nothere:bus", 2, "cannot import 'samples.nothere'"),
        ("samples.quickstart:nope", 2, "'samples.quickstart' has no attribute 'nope'"),
        ("samples.quickstart:OrderPlaced", 2, "is the class OrderPlaced, not a nmbus.Bus"),
        # A factory, or main itself, is never called: it might start the bus.
        ("samples.quickstart:main", 2, "is a function (a factory is not called here)"),
        ("samples.quickstart:bus.store", 2, "is a PostgresStore, not a nmbus.Bus"),
    ],
)
def test_a_bad_target_is_one_line(target: str, code: int, said: str) -> None:
    result = asyncapi(target)
    assert result.returncode == code, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], lines


def test_a_module_that_fails_while_imported_is_one_line() -> None:
    # The routes sample reads its second database's DSN when imported.
    env = {k: v for k, v in os.environ.items() if k not in ("NMBUS_DSN", "NMBUS_DB_B")}
    result = subprocess.run(
        [sys.executable, "-m", "nmbus", "asyncapi", "samples.routes:orders"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == ["error: KeyError: 'NMBUS_DB_B'"]


# -- the document, in this process (MemoryStore buses) ------------------------------------


class Cat(BaseModel):
    kind: Literal["cat"] = "cat"
    lives: int = 9


class Dog(BaseModel):
    kind: Literal["dog"] = "dog"
    bark: str


class Tree(BaseModel):
    value: int
    children: list[Tree] = []


class Awkward(Message, type_name="asyncapi_test:Awkward"):
    """Every shape pydantic writes differently from AsyncAPI's schema dialect."""

    pet: Annotated[Cat | Dog, Field(discriminator="kind")]
    pair: tuple[int, str]
    ratio: float = float("inf")
    discriminator: dict[str, int] = Field(default_factory=dict)
    tree: Tree | None = None


class Plain(Message, type_name="asyncapi_test_Awkward"):
    n: int


class Versioned(Message, type_name="asyncapi_test.Versioned", version=3):
    pass


def _bus(name: str = "awkward") -> Bus:
    return Bus(name, store=MemoryStore())


def test_pydantic_schemas_become_asyncapi_schemas(tmp_path: Path) -> None:
    bus = _bus()

    @bus.handler
    async def handle(msg: Awkward, ctx: Context) -> None: ...

    @bus.handler
    async def plain(msg: Plain, ctx: Context) -> None: ...

    bus.publishes(Awkward)
    bus.subscribe(Awkward, publisher="elsewhere")
    doc = document(bus)
    path = tmp_path / "awkward.json"
    path.write_text(json.dumps(doc, allow_nan=False), encoding="utf-8")
    parse_strictly([path])
    props = doc["components"]["schemas"]["Awkward"]["properties"]
    assert props["pair"]["items"] == [{"type": "integer"}, {"type": "string"}]
    assert "prefixItems" not in props["pair"]
    assert "discriminator" not in props["pet"] and len(props["pet"]["oneOf"]) == 2
    assert "default" not in props["ratio"]  # JSON has no infinity
    assert "discriminator" in props  # a field of that name stays
    assert doc["components"]["schemas"]["Tree"]["properties"]["children"]["items"] == {
        "$ref": "#/components/schemas/Tree"
    }
    # Two type names that make the same key get two keys.
    messages = doc["components"]["messages"]
    assert {m["name"] for m in messages.values()} == {
        "asyncapi_test:Awkward",
        "asyncapi_test_Awkward",
    }
    assert len(messages) == 2


def test_a_message_states_its_version(tmp_path: Path) -> None:
    bus = _bus("versioned")

    @bus.handler
    async def handle(msg: Versioned, ctx: Context) -> None: ...

    doc = document(bus)
    assert doc["components"]["messages"]["asyncapi_test.Versioned"]["x-nmbus-version"] == 3


def test_a_type_without_a_json_schema_is_named() -> None:
    class Opaque:
        pass

    class Holder(Message, type_name="asyncapi_test.Holder", arbitrary_types_allowed=True):
        thing: Opaque

    bus = _bus("opaque")

    @bus.handler(Holder)
    async def handle(msg: Message, ctx: Context) -> None: ...

    with pytest.raises(ConfigurationError, match=r"message type asyncapi_test\.Holder"):
        document(bus)


def test_declarations_are_checked_when_made() -> None:
    bus = _bus("declaring")
    with pytest.raises(ConfigurationError, match="at least one"):
        bus.publishes()
    with pytest.raises(ConfigurationError, match="Message subclasses"):
        bus.publishes(Message)
    with pytest.raises(ConfigurationError, match="Message subclasses"):
        bus.sends(int, to="billing")  # type: ignore[arg-type]
    with pytest.raises(InvalidQueueName):
        bus.sends(Plain, to="Bad Name!")
    assert bus.outgoing_types.published == {} and bus.outgoing_types.sent == {}


def test_the_cli_page_example_runs() -> None:
    # docs/cli.md, "The contract document": its Python block, in a process of its own
    # (its type names are the shop's).
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    section = text[text.index("## The contract document") :]
    [block] = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    result = subprocess.run(
        [sys.executable, "-c", block], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_names_with_dots_never_overwrite_each_other(tmp_path: Path) -> None:
    # Publisher "a.b" of type "c" and publisher "a" of type "b.c" make the same key.
    class C(Message, type_name="c"):
        n: int

    class BC(Message, type_name="b.c"):
        n: int

    bus = _bus("dots")
    bus.subscribe(C, publisher="a.b")
    bus.subscribe(BC, publisher="a")
    bus.sends(C, to="q.b")
    bus.sends(BC, to="q")
    doc = document(bus)
    ops = doc["operations"]
    assert len(ops) == 4
    assert {op["channel"]["$ref"] for op in ops.values()} == {
        "#/channels/published.a.b",
        "#/channels/published.a",
        "#/channels/queue.q.b",
        "#/channels/queue.q",
    }
    path = tmp_path / "dots.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    parse_strictly([path])


def test_an_endpoint_that_declares_nothing_has_its_queue_and_nothing_else(
    tmp_path: Path,
) -> None:
    doc = document(_bus("silent"))
    assert list(doc["channels"]) == ["queue.silent"] and doc["operations"] == {}
    assert doc["components"]["messages"] == {}
    path = tmp_path / "silent.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    parse_strictly([path])
