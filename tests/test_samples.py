"""The README's example runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_readme_example_is_the_quickstart_sample() -> None:
    readme = (ROOT / "README.md").read_text()
    sample = (ROOT / "samples" / "quickstart.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    assert blocks, "README.md shows no Python example"
    assert blocks[0].strip() in sample


def run_sample(name: str, dsn: str) -> subprocess.CompletedProcess[str]:
    """``python -m samples.<name>`` against ``dsn``, as its docstring says to run it."""
    return subprocess.run(
        [sys.executable, "-m", f"samples.{name}"],
        cwd=ROOT,
        env={**os.environ, "NMBUS_DSN": dsn},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


def test_quickstart_runs(dsn: str) -> None:
    result = run_sample("quickstart", dsn)
    assert "order 1 paid" in result.stdout
    assert "order 3 paid" in result.stdout
    assert "{'I': 0, 'R': 0, 'X': 4, 'F': 1}" in result.stdout


def test_request_reply_sample_runs(dsn: str) -> None:
    result = run_sample("request_reply", dsn)
    for line in ("apple: 0.50", "pear: 1.50", "fig: 3.60", "kiwi: 1.20", "plum: 2.00"):
        assert f"[storefront] {line}" in result.stdout
    assert "[pricing] quoting 1 x apple for acme" in result.stdout
    assert "[storefront] no reply from 'pricing' to pricing.GetQuote within 1s" in result.stdout
    # The storefront has no handlers, only replies to receive: nothing to warn about,
    # and the sample's output is its own lines, no log line of the library's.
    assert "warning" not in (result.stdout + result.stderr).lower(), result.stdout
    assert all(line.startswith("[") for line in result.stdout.splitlines()), result.stdout
    assert not re.search(r"\[(debug|info) *\]", result.stdout + result.stderr), result.stdout


def test_delivery_sample_runs(dsn: str) -> None:
    result = run_sample("delivery", dsn)
    lines = result.stdout.splitlines()
    assert lines[0] == "audit of acct-2 (priority first)"
    acct1 = [line for line in lines if line.startswith("acct-1 entry")]
    assert acct1 == ["acct-1 entry 0: balance 100.00", "acct-1 entry 1: balance 70.00"]
    assert "acct-2 entry 1: balance 30.00" in lines
    assert "never printed" not in result.stdout
    assert any(line.startswith("failure port: ledger #1: Expired:") for line in lines)
    assert any("PermanentError: entry 2 of acct-1" in line for line in lines)
    assert any(line.startswith("tick heartbeat due at") for line in lines)
    assert lines[-1].startswith("ledger: {'I': 1, 'R': 0, 'X': ")
    # Every queue is created before it is sent to: no warning that a send created one.
    assert "queue_created_by_send" not in result.stdout + result.stderr


def test_versions_sample_runs(dsn: str) -> None:
    lines = run_sample("versions", dsn).stdout.splitlines()
    # The last release's orders (version 1) got the currency from the upcaster.
    assert sorted(lines[:3]) == ["order 1: 12.50 EUR", "order 2: 7.25 EUR", "order 3: 99.00 USD"]
    assert lines[3:] == ["version 1: 2 messages", "version 2: 1 message"]


def test_flow_control_sample_runs(dsn: str) -> None:
    result = run_sample("flow_control", dsn)
    lines = result.stdout.splitlines()
    assert lines[0] == "cancelled before it started: 1"
    charged = re.fullmatch(
        r"charged 59 orders in ([\d.]+) s; at most (\d+) in any second", lines[1]
    )
    assert charged is not None, lines[1]
    assert float(charged[1]) >= 2.0 and int(charged[2]) <= 20  # 59 at 20 a second
    assert lines[2] == "exports running at once per tenant: {'big': 1, 'small': 1}"
    behind = re.fullmatch(r"the small tenant's export waited for (\d+) of the big .*", lines[3])
    assert behind is not None and int(behind[1]) < 10, lines[3]


def test_encryption_sample_reads_cards_in_the_clear_and_stores_them_sealed(dsn: str) -> None:
    result = run_sample("encryption", dsn)
    own = [line for line in result.stdout.splitlines() if "message_failed" not in line]
    assert own == [
        "order 1: charged the card ending 1111",
        "order 2: charged the card ending 1881",
        "failed: UnknownEncryptionKey: enc.CardCharged.card_number is encrypted with key id "
        "'k0', which this endpoint does not hold: add that key to encryption_keys "
        "(NMBUS_ENCRYPTION_KEYS)",
        "stored: key k0, 68 characters of base64",
    ]
    # The one line nmbus logs: the failure, with the key id and no key.
    assert "message_failed" in result.stdout


def test_middleware_sample_logs_each_orders_tenant_on_every_line(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NMBUS_DSN", dsn)  # the endpoints are built at import
    from samples.middleware import ORDERS

    result = run_sample("middleware", dsn)
    lines = result.stdout.splitlines()
    tenants = {order_id: tenant for order_id, tenant, _ in ORDERS}
    seen: set[tuple[str, str]] = set()
    for line in lines:
        fields = dict(part.split("=", 1) for part in line.split(" ") if "=" in part)
        # Every line names its service and the tenant of the order it is about.
        assert fields.get("tenant") == repr(tenants[int(fields["order_id"])]), line
        seen.add((fields["service"], fields["event"]))
    assert seen == {
        ("'http'", "'order_requested'"),
        ("'mw_orders'", "'order_placed'"),
        ("'mw_payments'", "'card_charged'"),
        ("'mw_orders'", "'order_paid'"),
    }
    assert len(lines) == 4 * len(ORDERS)


NOWHERE = "postgresql://nobody@127.0.0.1:1/nothing"


async def test_middleware_samples_services_carry_the_tenant_without_a_database(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from nmbus import InvalidMessage
    from nmbus.testing import HandlerTest

    monkeypatch.setenv("NMBUS_DSN", NOWHERE)  # the endpoints are built at import
    from samples.middleware import ChargeCard, PlaceOrder, http_app, orders, payments, post, web

    t = HandlerTest(orders)
    outcome = await t.handle(PlaceOrder(order_id=5, amount=3.0), headers={"tenant": "acme"})
    assert outcome.processed
    [charge] = t.sent
    assert charge.to == "mw_payments" and charge.message == ChargeCard(order_id=5, amount=3.0)
    assert charge.headers == {"tenant": "acme"}
    p = HandlerTest(payments)
    await p.handle(charge.message, headers=charge.headers, from_endpoint="mw_orders")
    [reply] = p.replies
    assert reply.to == "mw_orders" and reply.headers == {"tenant": "acme"}
    # Outside any tenant the outgoing hook refuses, before anything is written.
    with pytest.raises(InvalidMessage, match="sent outside any tenant"):
        await web.send(PlaceOrder(order_id=6, amount=1.0), to="mw_orders")
    status, answer = await post(http_app(web), "/orders", {"order_id": 6, "amount": 1.0}, {})
    assert status == 400 and "X-Tenant" in answer["error"]


async def test_fulfilment_sample_reminds_once_the_payment_is_overdue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from datetime import timedelta

    from nmbus.testing import SagaScenario

    monkeypatch.setenv("NMBUS_DSN", NOWHERE)  # the endpoint is built at import
    from samples.shop.fulfilment import Fulfilment, OrderPlaced, PaymentTaken, bus, plan

    monkeypatch.setattr(plan, "payment_due", 600.0)
    late = SagaScenario(bus, key=1)
    await late.handle(OrderPlaced(order_id=1, customer="ada"))
    await late.advance(timedelta(seconds=599))
    assert late.state == Fulfilment(order_id=1, customer="ada", placed=True)
    await late.advance(timedelta(seconds=1))
    assert late.state == Fulfilment(order_id=1, customer="ada", placed=True, reminded=True)
    await late.handle(PaymentTaken(order_id=1))
    assert late.state is not None and late.state.paid and not late.completed

    on_time = SagaScenario(bus, key=2)
    await on_time.handle(OrderPlaced(order_id=2, customer="bob"))
    await on_time.handle(PaymentTaken(order_id=2))
    from samples.shop.fulfilment import OrderShipped

    await on_time.handle(OrderShipped(order_id=2, carrier="post"))
    assert on_time.completed
    [ignored] = await on_time.advance(timedelta(hours=1))
    assert ignored.processed and (ignored.error_info or "").startswith("saga timeout ignored")
