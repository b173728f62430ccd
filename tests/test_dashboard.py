"""``nmbus dashboard`` for real: the command in a process of its own, driven by headless Chromium.

The browser is Debian's chromium through its chromedriver, named explicitly
(Selenium Manager never runs, nothing is downloaded). HTTP checks that need
no browser (refused POSTs, /metrics) use plain urllib against the same server.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import asyncpg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nmbus.ops.admin import Admin
from nmbus.postgres.sql import render
from tests.dashboard_server import Server, start
from tests.ops_data import Facts
from tests.procs import ROOT
from tests.waits import wait_until

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
TOKEN = "t0ken-for-the-tests"
PASSWORD = "hunter2-not-shown"
HOSTILE = '<script>window.pwned=1</script><img src=x onerror="window.pwned=2">'
HOSTILE_QUEUE = '<b>q"\\'  # a name nmbus refuses, registered by hand


def _with_password(dsn: str) -> str:
    # The test server trusts local connections, so a password in the DSN is
    # accepted and ignored: the dashboard must still never show it.
    return dsn.replace("postgresql://postgres@", f"postgresql://postgres:{PASSWORD}@", 1)


@pytest.fixture
def serve(dsn: str) -> Iterator[Callable[..., Awaitable[Server]]]:
    started: list[Server] = []

    async def run(*args: str, url_host: str = "127.0.0.1") -> Server:
        server = await start(_with_password(dsn), *args, url_host=url_host)
        started.append(server)
        return server

    yield run
    for server in started:
        server.proc.terminate()
        try:
            server.proc.wait(15)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(10)
        for stream in (server.proc.stdout, server.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1500,900",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


async def note(browser: Any) -> str:
    """The note of the page a change ended on, once that page has loaded."""
    from selenium.webdriver.common.by import By

    found = await wait_until(lambda: browser.find_elements(By.ID, "note"))
    return str(found[0].text)


def cell(browser: Any, queue: str, column: str) -> str:
    """One cell's text, read in one script run.

    The page swaps its table in place every refresh: a row found by one
    WebDriver call can be gone by the next (a stale element). Inside one
    script the DOM cannot change under the read.
    """
    text = browser.execute_script(
        "const sel = 'tr[data-queue=\"' + CSS.escape(arguments[0]) + '\"] td[data-col=\"'"
        " + CSS.escape(arguments[1]) + '\"]';"
        "const td = document.querySelector(sel);"
        "return td === null ? null : td.innerText.trim();",
        queue,
        column,
    )
    if text is None:
        raise AssertionError(f"no cell {column!r} for queue {queue!r} on the page")
    return str(text)


def queue_names(browser: Any) -> list[str]:
    """The queue names in the table, read in one script run (see `cell`)."""
    found = browser.execute_script(
        "return Array.from(document.querySelectorAll('td.name'), td => td.innerText.trim());"
    )
    return [str(name) for name in found]


def click_id(browser: Any, element_id: str) -> None:
    """Click an element the page may swap between the find and the click."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    for _ in range(10):
        try:
            browser.find_element(By.ID, element_id).click()
            return
        except StaleElementReferenceException:
            continue
    raise AssertionError(f"#{element_id} was swapped under every one of 10 clicks")


def text_of(browser: Any, element_id: str) -> str:
    """One element's text, read in one script run (see `cell`)."""
    text = browser.execute_script(
        "const el = document.getElementById(arguments[0]);"
        "return el === null ? null : el.innerText.trim();",
        element_id,
    )
    if text is None:
        raise AssertionError(f"no #{element_id} on the page")
    return str(text)


# -- in the browser ------------------------------------------------------------------------


async def test_queues_page_shows_every_queue_and_its_counts(
    serve: Callable[..., Server], browser: Any, facts: Facts, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    server = await serve("--token", TOKEN)
    browser.get(server.url + "/")
    names = queue_names(browser)
    assert names == ["billing", "shipping"]
    # ops_data: billing has 6 I, 3 R, 165 X, 3 F; shipping 1 I.
    assert [cell(browser, "billing", c) for c in "IRXF"] == ["6", "3", "165", "3"]
    assert [cell(browser, "shipping", c) for c in "IRXF"] == ["1", "0", "0", "0"]
    # The last hour: 100 X rows of 1..100 ms and 3 F rows (ops_data).
    hour = ["hour-p50", "hour-p95", "hour-p99", "hour-fail-rate"]
    assert [cell(browser, "billing", c) for c in hour] == ["50.5", "95.0", "99.0", "2.9 %"]
    assert browser.find_elements(By.CSS_SELECTOR, 'tr[data-queue="billing"] svg.spark rect')
    assert PASSWORD not in browser.page_source
    assert "postgres:***@" in browser.page_source
    shot = tmp_path / "queues.png"
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


WRAPPED_HEADINGS = """
return Array.from(document.querySelectorAll('#queues-table th'), th => {
  const range = document.createRange();
  range.selectNodeContents(th);
  const lines = new Set(Array.from(range.getClientRects(), r => Math.round(r.top)));
  return [th.innerText.trim(), lines.size];
}).filter(heading => heading[1] > 1).map(heading => heading[0]);
"""


async def test_the_queues_table_headings_keep_to_one_line_at_1400_px(
    serve: Callable[..., Server], browser: Any, facts: Facts
) -> None:
    server = await serve()
    browser.set_window_size(1400, 900)
    browser.get(server.url + "/")
    assert queue_names(browser) == ["billing", "shipping"]
    assert browser.execute_script(WRAPPED_HEADINGS) == []  # "fail rate" wrapped here
    right, width = browser.execute_script(
        "return [document.getElementById('queues-table').getBoundingClientRect().right,"
        " document.documentElement.clientWidth];"
    )
    assert right <= width, f"the table is {right - width:.0f} px wider than a 1400 px window"


async def test_the_queues_page_refreshes_itself_without_a_reload(
    serve: Callable[..., Server], browser: Any, facts: Facts, db: asyncpg.Connection
) -> None:
    server = await serve("--token", TOKEN, "--refresh", "1")
    browser.get(server.url + "/")
    browser.execute_script("window.notReloaded = true;")
    assert cell(browser, "shipping", "I") == "1"
    await db.execute(
        "INSERT INTO nmbus.shipping (from_endpoint, to_endpoint, label, msg_text) "
        "SELECT 'orders', 'shipping', 'x', '{}' FROM generate_series(1, 4)"
    )
    await wait_until(lambda: cell(browser, "shipping", "I"), until=lambda text: text == "5")
    assert browser.execute_script("return window.notReloaded === true;")


async def test_open_a_failed_message_and_requeue_it_with_the_token(
    serve: Callable[..., Server],
    browser: Any,
    facts: Facts,
    db: asyncpg.Connection,
    tmp_path: Path,
) -> None:
    from selenium.webdriver.common.by import By

    first = facts.failed_ids[0]
    await db.execute(
        'UPDATE nmbus.billing SET msg_headers = \'{"tenant": "acme", "trace": "t-1"}\' '
        "WHERE id = $1",
        first,
    )
    server = await serve("--token", TOKEN)
    browser.get(server.url + "/failed?queue=billing")
    links = browser.find_elements(By.CSS_SELECTOR, "#failed-table a.open")
    assert [int(a.text) for a in links] == facts.failed_ids[::-1]  # newest first
    browser.find_element(By.LINK_TEXT, str(first)).click()
    assert browser.find_element(By.ID, "subqueue").text == "F"
    assert "card declined" in browser.find_element(By.ID, "error").text
    assert '"order_id": 1' in browser.find_element(By.ID, "body").text
    assert '"trace": "t-1"' in browser.find_element(By.ID, "headers").text
    # A message sent without headers says so, instead of an empty box.
    for stored in ("NULL", "'{}'"):
        await db.execute(
            f"UPDATE nmbus.billing SET msg_headers = {stored} WHERE id = $1", facts.failed_ids[1]
        )
        browser.get(f"{server.url}/failed/billing/{facts.failed_ids[1]}")
        none = browser.find_element(By.ID, "headers")
        assert (none.tag_name, none.text) == ("p", "no headers"), stored
    browser.get(f"{server.url}/failed/billing/{first}")
    browser.find_element(By.ID, "requeue-one").click()
    assert "1 failed message" in browser.find_element(By.ID, "summary").text
    browser.save_screenshot(str(tmp_path / "confirm.png"))
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.ID, "do-it").click()
    # The click starts a navigation; the page that answers it may not be there yet.
    assert await note(browser) == "requeued 1 message"
    row = await db.fetchrow("SELECT subqueue, retry_count FROM nmbus.billing WHERE id = $1", first)
    assert (row["subqueue"], row["retry_count"]) == ("I", 0)
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing WHERE subqueue = 'F'") == 2


async def test_requeue_all_matching_and_purge_with_a_filter(
    serve: Callable[..., Server], browser: Any, facts: Facts, db: asyncpg.Connection
) -> None:
    from selenium.webdriver.common.by import By

    server = await serve("--token", TOKEN)
    browser.get(server.url + "/failed?" + urlencode({"error": "DECLINED"}))
    assert len(browser.find_elements(By.CSS_SELECTOR, "#failed-table a.open")) == 2
    browser.find_element(By.ID, "purge-matching").click()
    assert "2 failed messages" in browser.find_element(By.ID, "summary").text
    browser.find_element(By.ID, "token").send_keys("not-the-token!")
    browser.find_element(By.ID, "do-it").click()
    found = await wait_until(lambda: browser.find_elements(By.ID, "message"))
    assert "wrong token" in found[0].text
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing WHERE subqueue = 'F'") == 3
    browser.back()
    token = browser.find_element(By.ID, "token")
    token.clear()
    token.send_keys(TOKEN)
    browser.find_element(By.ID, "do-it").click()
    assert await note(browser) == "purged 2 messages"
    left = await db.fetch("SELECT label FROM nmbus.billing WHERE subqueue = 'F'")
    assert [r["label"] for r in left] == ["billing.Refund"]


async def test_hostile_text_from_the_database_is_shown_as_text(
    serve: Callable[..., Server], browser: Any, facts: Facts, db: asyncpg.Connection
) -> None:
    from selenium.webdriver.common.by import By

    await db.execute(
        "UPDATE nmbus.billing SET label = $1, error_info = $1, msg_text = $1 WHERE id = $2",
        HOSTILE,
        facts.failed_ids[0],
    )
    await db.execute(
        "INSERT INTO nmbus.subscriptions VALUES ('orders', $1, $1, now(), NULL)", HOSTILE
    )
    # A table registered by hand under a name nmbus itself would refuse.
    await db.execute(render("create_queue", "nmbus", HOSTILE_QUEUE))
    await db.execute(render("register_queue", "nmbus"), HOSTILE_QUEUE)
    server = await serve("--token", TOKEN)
    for path in ("/failed", f"/failed/billing/{facts.failed_ids[0]}", "/subscriptions"):
        browser.get(server.url + path)
        assert HOSTILE in browser.find_element(By.TAG_NAME, "main").text
        assert browser.execute_script("return window.pwned === undefined;")
        assert not browser.find_elements(By.CSS_SELECTOR, "main script, main img, main b")
    browser.get(server.url + "/")
    names = queue_names(browser)
    assert HOSTILE_QUEUE in names
    assert browser.execute_script("return window.pwned === undefined;")
    assert not browser.find_elements(By.CSS_SELECTOR, "main b")
    _, text, _ = server.get("/metrics")
    found = {f.name: f for f in text_string_to_metric_families(text)}
    queues = {s.labels["queue"] for s in found["nmbus_queue_messages"].samples}
    assert HOSTILE_QUEUE in queues


async def test_queue_page_draws_its_history(
    serve: Callable[..., Server], browser: Any, facts: Facts
) -> None:
    from selenium.webdriver.common.by import By

    server = await serve("--token", TOKEN)
    browser.get(server.url + "/queues/billing")
    # Read in one script run: the page swaps its body in place every refresh.
    bars = browser.execute_script(
        "return Array.from(document.querySelectorAll('svg.history g'), g =>"
        " Array.from(g.querySelectorAll('rect'), r => parseFloat(r.getAttribute('height'))));"
    )
    assert len(bars) == 60
    assert sum(bars[-3]) > 0
    assert browser.find_elements(By.CSS_SELECTOR, "svg.history polyline")
    assert "last 5 min" in browser.find_element(By.TAG_NAME, "main").text


async def test_queue_page_shows_flow_limits_and_what_they_hold_back(
    serve: Callable[..., Server], browser: Any, facts: Facts, db: asyncpg.Connection, dsn: str
) -> None:
    from selenium.webdriver.common.by import By

    await db.execute(
        """INSERT INTO nmbus."flow$limits" (queue, key, limits, labels, concurrency, declared_by)
           VALUES ('billing', 'billing.Charge:charge', 'concurrency=1', '{billing.Charge}', 1,
                   'host:1:abc')"""
    )
    async with Admin(dsn) as admin:
        (limit,) = await admin.flow_status(["billing"])
    assert limit.waiting > 0
    server = await serve("--token", TOKEN)
    browser.get(server.url + "/queues/billing")
    rows = browser.execute_script(  # in one script run, as `cell`
        "return Array.from(document.querySelectorAll('#limits tbody tr'), tr =>"
        " Array.from(tr.querySelectorAll('td'), td => td.innerText.trim()));"
    )
    assert len(rows) == 1
    cells = rows[0]
    assert cells == [
        "billing.Charge:charge",
        "concurrency=1",
        str(limit.in_flight),
        "-",
        str(limit.waiting),
        str(limit.held_back),
    ]
    browser.get(server.url + "/queues/shipping")
    assert browser.find_elements(By.ID, "segments-summary")
    assert not browser.find_elements(By.ID, "limits")


async def test_subscriptions_page_marks_expired_rows(
    serve: Callable[..., Server], browser: Any, facts: Facts
) -> None:
    from selenium.webdriver.common.by import By

    server = await serve("--token", TOKEN)
    browser.get(server.url + "/subscriptions")
    expired = browser.find_elements(By.CSS_SELECTOR, "#subscriptions tr.expired")
    assert [r.find_elements(By.TAG_NAME, "td")[2].text for r in expired] == ["audit"]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#subscriptions tbody tr")) == 5


# -- HTTP: changes that must be refused ---------------------------------------------------


def _form(
    server: Server, query: str, cookie: dict[str, str] | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """The confirmation form's hidden fields (as a browser sends them) and its cookie."""
    status, page, headers = server.get("/confirm?" + query, cookie)
    assert status == 200, page
    if cookie is None:
        cookie = {"Cookie": headers["set-cookie"].split(";")[0]}
    fields = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', page))
    return {k: html.unescape(v) for k, v in fields.items()}, cookie


async def test_a_change_without_token_or_csrf_is_refused(
    serve: Callable[..., Server], facts: Facts, db: asyncpg.Connection
) -> None:
    server = await serve("--token", TOKEN)
    first = str(facts.failed_ids[0])
    form, cookie = _form(server, f"action=requeue&queue=billing&id={first}")
    form["id"] = first
    refused = [
        ({**form}, cookie, "wrong token"),  # no token
        ({**form, "token": TOKEN[:-1]}, cookie, "wrong token"),
        ({**form, "token": TOKEN}, {}, "CSRF"),  # no cookie
        ({**form, "token": TOKEN, "csrf": "forged"}, cookie, "CSRF"),
        (
            {**form, "token": TOKEN},
            {**cookie, "Origin": "http://evil.example"},
            "another site",
        ),
        ({**form, "token": TOKEN, "confirm": ""}, cookie, "not confirmed"),
        ({**form, "token": TOKEN, "queue": ""}, cookie, "needs its queue"),
        ({**form, "token": TOKEN, "id": "1 OR 1=1"}, cookie, "not a message id"),
    ]
    for fields, headers, why in refused:
        status, body = server.post("/actions/requeue", fields, headers)
        assert status in (400, 403) and why in body, (fields, headers, body)
    assert server.get("/actions/requeue")[0] == 405  # a GET never changes anything
    assert await db.fetchval("SELECT subqueue FROM nmbus.billing WHERE id = $1", int(first)) == "F"
    status, _ = server.post("/actions/requeue", {**form, "token": TOKEN}, cookie)
    assert status == 303
    assert await db.fetchval("SELECT subqueue FROM nmbus.billing WHERE id = $1", int(first)) == "I"


async def test_pages_answer_only_to_this_machines_own_names(
    serve: Callable[..., Server], facts: Facts
) -> None:
    # A page of another site whose name was rebound to 127.0.0.1 sends its own
    # name as Host: on loopback the dashboard does not answer it.
    server = await serve("--token", TOKEN)
    assert server.get("/")[0] == 200
    assert server.get("/", {"Host": "localhost"})[0] == 200
    assert server.get("/", {"Host": "rebound.example"})[0] == 400
    assert server.get("/metrics", {"Host": "rebound.example:8787"})[0] == 400


async def test_read_only_refuses_every_change(
    serve: Callable[..., Server], facts: Facts, db: asyncpg.Connection
) -> None:
    server = await serve("--token", TOKEN, "--read-only")
    status, html, _ = server.get("/failed")
    assert status == 200 and "read-only" in html and "Requeue" not in html
    assert server.get("/confirm?action=purge&queue=billing")[0] == 403
    status, body = server.post(
        "/actions/purge",
        {"token": TOKEN, "csrf": "x", "confirm": "yes", "queue": "billing"},
        {"Cookie": "nmbus_csrf=x"},
    )
    assert status == 403 and "read-only" in body
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing WHERE subqueue = 'F'") == 3


def test_starting_beyond_loopback_without_a_token_is_wrong_usage(dsn: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NMBUS_DASHBOARD_TOKEN"}
    for host in ("0.0.0.0", "::", "192.0.2.1"):
        done = subprocess.run(
            [sys.executable, "-m", "nmbus", "dashboard", "--dsn", dsn, "--host", host],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2  # wrong usage (docs/cli.md)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"error: refusing to listen on {host} without a token"
        ), done.stderr
    short = subprocess.run(
        [sys.executable, "-m", "nmbus", "dashboard", "--dsn", dsn, "--token", "short"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert short.returncode == 2 and "token is too short" in short.stderr


def test_a_missing_schema_is_one_line(dsn: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "nmbus", "dashboard", "--dsn", dsn, "--schema", "nosuch"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: no nmbus schema 'nosuch' in this database: no queues (check --dsn and --schema)"
    ]


# -- /metrics -----------------------------------------------------------------------------


async def test_metrics_parse_and_carry_the_documented_series(
    serve: Callable[..., Server], facts: Facts
) -> None:
    server = await serve("--token", TOKEN)
    status, text, headers = server.get("/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    assert PASSWORD not in text
    found = {f.name: f for f in text_string_to_metric_families(text)}
    documented = (ROOT / "docs" / "metrics.md").read_text()
    for name in found:
        assert f"`{name}`" in documented, name
    depth = {
        (s.labels["queue"], s.labels["subqueue"]): s.value
        for s in found["nmbus_queue_messages"].samples
    }
    assert depth == {
        ("billing", "I"): 6,
        ("billing", "R"): 3,
        ("billing", "X"): 165,
        ("billing", "F"): 3,
        ("shipping", "I"): 1,
        ("shipping", "R"): 0,
        ("shipping", "X"): 0,
        ("shipping", "F"): 0,
    }
    oldest = {
        s.labels["queue"]: s.value for s in found["nmbus_queue_oldest_ready_age_seconds"].samples
    }
    assert 1800 <= oldest["billing"] < 1920
    in_flight = {
        s.labels["queue"]: s.value for s in found["nmbus_queue_in_flight_messages"].samples
    }
    assert in_flight == {"billing": 2, "shipping": 0}
    for family in found.values():
        assert family.type == "gauge"


# -- every loopback address, bounded changes, bad input, long texts -----------------------


@pytest.mark.parametrize(
    ("host", "url_host", "own"),
    [
        ("::1", "[::1]", "[::1]"),
        ("127.0.0.2", "127.0.0.2", "127.0.0.2"),
        ("localhost", "localhost", "localhost"),
    ],
)
async def test_every_loopback_address_answers_only_its_own_names(
    serve: Callable[..., Server], facts: Facts, host: str, url_host: str, own: str
) -> None:
    # DNS rebinding: a page of another site whose name now resolves to this
    # loopback address sends its own name as Host. Whatever loopback address
    # the dashboard listens on, only this machine's names are answered.
    server = await serve("--token", TOKEN, "--host", host, url_host=url_host)
    port = server.url.rsplit(":", 1)[1]
    assert server.get("/")[0] == 200
    assert server.get("/", {"Host": f"{own}:{port}"})[0] == 200
    assert server.get("/", {"Host": f"localhost:{port}"})[0] == 200
    for foreign in ("rebound.example", f"rebound.example:{port}", f"[::2]:{port}", ""):
        status, body, _ = server.get("/metrics", {"Host": foreign})
        assert status == 400 and "queue" not in body, (foreign, body)


async def test_a_change_acts_only_on_what_its_confirmation_counted(
    serve: Callable[..., Server], browser: Any, facts: Facts, db: asyncpg.Connection
) -> None:
    from selenium.webdriver.common.by import By

    server = await serve("--token", TOKEN)
    browser.get(server.url + "/failed?queue=billing")
    browser.find_element(By.ID, "purge-matching").click()
    assert "3 failed messages" in browser.find_element(By.ID, "summary").text
    # While the operator reads the confirmation, 500 new messages fail, and an
    # old one (a low id) fails its last attempt.
    await db.execute(
        "INSERT INTO nmbus.billing (from_endpoint, to_endpoint, subqueue, last_processed, "
        "label, msg_text, error_info) SELECT 'orders', 'billing', 'F', clock_timestamp(), "
        "'billing.Charge', '{}', 'ValueError: card declined' FROM generate_series(1, 500)"
    )
    old = await db.fetchval("SELECT min(id) FROM nmbus.billing WHERE subqueue = 'I'")
    await db.execute(
        "UPDATE nmbus.billing SET subqueue = 'F', last_processed = clock_timestamp() WHERE id = $1",
        old,
    )
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.ID, "do-it").click()
    assert await note(browser) == (
        "purged 3 messages; 501 more matching failed after the confirmation and were left "
        "as they are (confirm again to purge them)"
    )
    left = await db.fetch("SELECT id FROM nmbus.billing WHERE subqueue = 'F'")
    assert len(left) == 501 and old in {r["id"] for r in left}
    assert not set(facts.failed_ids) & {r["id"] for r in left}


async def test_a_requeue_by_form_is_bound_to_its_count_too(
    serve: Callable[..., Server], facts: Facts, db: asyncpg.Connection
) -> None:
    server = await serve("--token", TOKEN)
    form, cookie = _form(server, "action=requeue&queue=billing&error=declined")
    await db.execute(
        "UPDATE nmbus.billing SET subqueue = 'F', last_processed = clock_timestamp(), "
        "error_info = 'ValueError: card declined' WHERE subqueue = 'I'"
    )
    status, _ = server.post("/actions/requeue", {**form, "token": TOKEN}, cookie)
    assert status == 303
    requeued = await db.fetchval(
        "SELECT count(*) FROM nmbus.billing WHERE id = ANY($1) AND subqueue = 'I'",
        facts.failed_ids,
    )
    assert requeued == 2  # the two Charge failures the confirmation counted
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing WHERE subqueue = 'F'") == 7
    # A form that does not carry its confirmation's count changes nothing.
    del form["counted"]
    status, body = server.post("/actions/purge", {**form, "token": TOKEN}, cookie)
    assert status == 400 and "does not say what was confirmed" in body
    tampered = {**form, "counted": '[["billing", 1, "1 OR 1=1", "now"]]', "token": TOKEN}
    status, body = server.post("/actions/purge", tampered, cookie)
    assert status == 400 and "not valid" in body
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing WHERE subqueue = 'F'") == 7


async def test_bad_filters_and_cursors_are_clear_400s(
    serve: Callable[..., Server], facts: Facts
) -> None:
    server = await serve("--token", TOKEN)
    cases = [
        ("/failed?error=%00", "the error filter holds a NUL character"),
        ("/failed?type=a%00b", "the type filter holds a NUL character"),
        ("/failed?queue=billing%00", "the queue filter holds a NUL character"),
        ("/confirm?action=purge&error=%00", "the error filter holds a NUL character"),
        (f"/failed?cursor=billing:{2**63}", "not a page cursor"),
        ("/failed?cursor=billing:9999999999999999999", "not a page cursor"),
        ("/failed?cursor=billing:99999999999999999999999999999", "not a page cursor"),
        ("/?page=0", "not a page number"),
        ("/?page=x", "not a page number"),
        ("/?page=99999999999", "not a page number"),
    ]
    for path, why in cases:
        status, body, _ = server.get(path)
        assert status == 400 and why in html.unescape(body), (path, status, body[-500:])
    # The largest id there can be is a cursor like any other: the page is shown.
    status, body, _ = server.get(f"/failed?cursor=billing:{2**63 - 1}")
    assert status == 200 and "failed-table" in body


async def test_long_texts_are_cut_with_a_link_to_the_whole_text(
    serve: Callable[..., Server], browser: Any, facts: Facts, db: asyncpg.Connection
) -> None:
    from selenium.webdriver.common.by import By

    first = facts.failed_ids[0]
    error_line = HOSTILE + "E" * (5 * 1024 * 1024)
    await db.execute(
        "UPDATE nmbus.billing SET error_info = $1 || E'\\nTraceback: the rest', "
        "msg_text = $2 || repeat('b', 40 * 1024 * 1024) WHERE id = $3",
        error_line,
        HOSTILE,
        first,
    )
    server = await serve("--token", TOKEN)
    status, page, _ = server.get("/failed?queue=billing")
    assert status == 200 and len(page) < 100_000
    status, page, _ = server.get(f"/failed/billing/{first}")
    assert status == 200 and len(page) < 400_000
    status, body, headers = server.get(f"/failed/billing/{first}/body")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert headers["x-content-type-options"] == "nosniff"
    assert body == HOSTILE + "b" * (40 * 1024 * 1024)
    browser.get(server.url + "/failed?queue=billing")
    cut = browser.find_elements(By.CSS_SELECTOR, "#failed-table td.error a.cut")
    assert len(cut) == 1
    cut[0].click()
    await wait_until(
        lambda: browser.current_url,
        until=lambda url: url.endswith(f"/failed/billing/{first}/error"),
    )
    shown = browser.find_element(By.TAG_NAME, "body").text
    assert shown.startswith(HOSTILE) and shown.endswith("Traceback: the rest")
    assert browser.execute_script("return window.pwned === undefined;")
    browser.get(server.url + f"/failed/billing/{first}")
    for part, whole in (("error", len(error_line) + 20), ("body", len(HOSTILE) + 40 * 1024**2)):
        assert f"of {whole:,} characters" in browser.find_element(By.ID, f"{part}-cut").text
        assert len(browser.find_element(By.ID, part).text) <= 64 * 1024
    assert browser.find_element(By.ID, "body").text.startswith(HOSTILE)
    assert not browser.find_elements(By.ID, "headers-cut")
    assert '"tenant": "acme"' in browser.find_element(By.ID, "headers").text
    assert browser.execute_script("return window.pwned === undefined;")
    # The whole 40 MB body was read over HTTP above; in a browser only its link is checked
    # (rendering 40 MB of text took the renderer over a minute on a busy machine).
    whole = browser.find_element(By.LINK_TEXT, "the whole body").get_attribute("href")
    assert whole == server.url + f"/failed/billing/{first}/body"


# -- many queues --------------------------------------------------------------------------


async def _many_queues(db: asyncpg.Connection, count: int) -> list[str]:
    names = [f"many{k:03d}" for k in range(count)]
    for name in names:
        await db.execute(render("create_queue", "nmbus", name))
        await db.execute(render("register_queue", "nmbus"), name)
    return names


async def test_the_queues_page_pages_many_queues_attention_first(
    serve: Callable[..., Server], browser: Any, facts: Facts, db: asyncpg.Connection
) -> None:
    from selenium.webdriver.common.by import By

    many = await _many_queues(db, 120)
    await db.execute(render("create_queue", "nmbus", "zzz_failing"))
    await db.execute(render("register_queue", "nmbus"), "zzz_failing")
    await db.execute(render("create_queue", "nmbus", "zzz_waiting"))
    await db.execute(render("register_queue", "nmbus"), "zzz_waiting")
    await db.execute(
        "INSERT INTO nmbus.zzz_failing (from_endpoint, to_endpoint, subqueue, last_processed, "
        "label, msg_text, error_info) VALUES ('o', 'zzz_failing', 'F', now(), 'x', '{}', 'E')"
    )
    await db.execute(
        "INSERT INTO nmbus.zzz_waiting (from_endpoint, to_endpoint, retry_time, label, msg_text) "
        "VALUES ('o', 'zzz_waiting', now() - interval '2 hours', 'x', '{}')"
    )
    total = len(many) + 4

    server = await serve("--token", TOKEN, "--refresh", "1")
    status, page, _ = server.get("/")
    assert status == 200 and page.count("<tr data-queue=") == 50
    browser.get(server.url + "/")
    # Failed messages first (billing has waited longer), then the longest wait.
    assert queue_names(browser)[:4] == ["billing", "zzz_failing", "zzz_waiting", "shipping"]
    assert queue_names(browser)[4:] == many[:46]
    assert text_of(browser, "paging").startswith(f"Queues 1–50 of {total}")
    click_id(browser, "next")
    await wait_until(lambda: browser.current_url, until=lambda url: "page=2" in url)
    assert queue_names(browser) == many[46:96]
    browser.execute_script("window.notReloaded = true;")
    # After a refresh of the table (the script stamps it) it is still page 2.
    await wait_until(
        lambda: text_of(browser, "updated"),
        until=lambda text: text.startswith("updated"),
    )
    assert queue_names(browser) == many[46:96]
    assert browser.execute_script("return window.notReloaded === true;")
    click_id(browser, "next")
    await wait_until(lambda: browser.current_url, until=lambda url: "page=3" in url)
    assert queue_names(browser) == many[96:]
    assert not browser.find_elements(By.ID, "next")
    query = browser.find_element(By.ID, "q")
    query.send_keys("MANY01")
    query.submit()
    await wait_until(lambda: browser.current_url, until=lambda url: "q=MANY01" in url)
    assert queue_names(browser) == many[10:20]
    assert "10 of" in text_of(browser, "paging")


async def test_metrics_read_every_queue_in_a_few_statements(
    facts: Facts, db: asyncpg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nmbus.dashboard.metrics import exposition
    from nmbus.ops.admin import DEPTH_CHUNK, Admin

    await _many_queues(db, 3 * DEPTH_CHUNK)
    await db.execute(
        "INSERT INTO nmbus.many007 (from_endpoint, to_endpoint, label, msg_text) "
        "SELECT 'o', 'many007', 'x', '{}' FROM generate_series(1, 7)"
    )
    statements: list[str] = []
    create_pool = asyncpg.create_pool

    def counting_pool(*args: Any, **kwargs: Any) -> Any:
        given = kwargs.pop("init", None)  # the operations' own session settings

        async def init(conn: asyncpg.Connection) -> None:
            if given is not None:
                await given(conn)
            conn.add_query_logger(lambda record: statements.append(record.query))

        return create_pool(*args, init=init, **kwargs)

    monkeypatch.setattr(asyncpg, "create_pool", counting_pool)
    async with Admin(dsn, pool_size=2) as admin:
        status = {q.queue: q for q in await admin.queue_status()}
        statements.clear()
        text = (await exposition(admin)).decode()
    queues = len(status)
    # Not some statements per queue: one for the sizes, and per chunk of queues
    # one for the depths and one for the exact X counts (and their transactions).
    chunks = -(-queues // DEPTH_CHUNK)
    # (Leaving out transactions, and the reset the pool runs on each connection it gets back.)
    skip = ("BEGIN", "COMMIT", "SAVEPOINT", "RELEASE", "SELECT pg_advisory_unlock_all()")
    reads = [s for s in statements if not s.startswith(skip)]
    assert len(reads) <= 2 + 2 * chunks, [r[:60] for r in reads]
    found = {f.name: f for f in text_string_to_metric_families(text)}
    depth = {
        (s.labels["queue"], s.labels["subqueue"]): s.value
        for s in found["nmbus_queue_messages"].samples
    }
    for name, q in status.items():
        expected = [q.ready, q.scheduled, q.processed, q.failed]
        assert [depth[(name, letter)] for letter in "IRXF"] == expected, name
    assert depth[("many007", "I")] == 7
    blocked = {s.labels["queue"]: s.value for s in found["nmbus_queue_blocked_sequences"].samples}
    assert blocked == {name: len(q.blocked) for name, q in status.items()}


# -- what a new user sees -----------------------------------------------------------------


BLOCK_THE_EXTRA = """
import sys
from importlib.abc import MetaPathFinder

class Blocker(MetaPathFinder):
    # As in an installation of nmbus without its dashboard extra.
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {"starlette", "jinja2", "markupsafe", "uvicorn"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Blocker())
sys.argv = ["nmbus", *sys.argv[1:]]
from nmbus.cli import main
main()
"""


def test_without_the_extra_the_command_says_what_to_install(dsn: str) -> None:
    for args in ([], ["--host", "::1"], ["--host", "0.0.0.0"]):
        done = subprocess.run(
            [sys.executable, "-c", BLOCK_THE_EXTRA, "dashboard", "--dsn", dsn, *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 1, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert lines[0].startswith("error: the dashboard needs its extra (")
        assert lines[0].endswith("pip install 'nmbus[dashboard]'")
    # The package itself imports without the extra (the host checks are plain Python).
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            BLOCK_THE_EXTRA.split("sys.argv")[0]
            + "import nmbus.dashboard as d\nprint(d.is_loopback('::1'))",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == "True", done.stderr


async def test_the_header_names_the_schema_and_times_say_utc(
    serve: Callable[..., Server], browser: Any, facts: Facts, db: asyncpg.Connection
) -> None:
    from selenium.webdriver.common.by import By

    from nmbus.ports.store import SCHEMA_VERSION

    server = await serve("--token", TOKEN)
    for path in ("/", "/queues/billing", "/failed", "/subscriptions"):
        browser.get(server.url + path)
        header = browser.find_element(By.ID, "database").text
        assert header.endswith(f"· schema nmbus (version {SCHEMA_VERSION})"), header
        assert not browser.find_elements(By.ID, "capped"), path  # nothing is capped
    browser.get(server.url + "/subscriptions")
    heads = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#subscriptions th")]
    assert heads[3:5] == ["created (UTC)", "expires (UTC)"]
    browser.get(server.url + f"/failed/billing/{facts.failed_ids[0]}")
    times = browser.find_elements(By.CSS_SELECTOR, "table.fields td")
    assert sum(t.text.endswith(" UTC") for t in times) == 2
    # More X rows in the last 5 minutes than a window reads: now the footnote shows.
    from nmbus.ops.admin import WINDOW_ROWS

    await db.execute(
        "INSERT INTO nmbus.shipping (from_endpoint, to_endpoint, subqueue, last_processed, "
        "label, msg_text) SELECT 'o', 'shipping', 'X', now(), 'x', '{}' "
        "FROM generate_series(0, $1::int)",
        WINDOW_ROWS,
    )
    for path in ("/", "/queues/shipping"):
        browser.get(server.url + path)
        assert "more rows than the dashboard reads" in browser.find_element(By.ID, "capped").text


# -- a queue a send created -----------------------------------------------------------------


async def test_a_queue_a_send_created_is_marked_until_its_endpoint_starts(
    serve: Callable[..., Server], browser: Any, make_bus: Callable[..., Any]
) -> None:
    from tests.messages import Ping

    note = "created by a send from orders, no endpoint has started on it"
    async with make_bus("orders", concurrency=0) as sender:
        await sender.send(Ping(n=1), to="bililng")  # a typo

    def mark(queue: str) -> str | None:
        found = browser.execute_script(
            "const sel = 'tr[data-queue=\"' + CSS.escape(arguments[0]) + '\"] "
            '[data-mark="created-by-send"]\';'
            "const el = document.querySelector(sel);"
            "return el === null ? null : el.innerText.trim();",
            queue,
        )
        return None if found is None else str(found)

    server = await serve("--token", TOKEN, "--refresh", "1")
    browser.get(server.url + "/")
    assert mark("bililng") == note
    assert mark("orders") is None
    browser.get(server.url + "/queues/bililng")
    assert note in browser.find_element("id", "created-by-send").text
    browser.get(server.url + "/")
    browser.execute_script("window.notReloaded = true;")
    # Its endpoint starts: the mark goes at the next refresh of the table.
    async with make_bus("bililng", concurrency=0):
        pass
    await wait_until(
        lambda: (mark("bililng"), cell(browser, "bililng", "I")),
        until=lambda seen: seen == (None, "1"),
    )
    assert browser.execute_script("return window.notReloaded === true;")
    browser.get(server.url + "/queues/bililng")
    assert not browser.find_elements("id", "created-by-send")


# -- ready rows held by a blocked sequence -------------------------------------------------


async def test_oldest_ready_says_blocked_where_ready_rows_wait_behind_a_sequence(
    serve: Callable[..., Server], browser: Any, make_bus: Callable[..., Any], db: asyncpg.Connection
) -> None:
    """The dashboard showed "–" where `nmbus status` says `blocked`."""
    from tests.messages import Ping, Posted

    async with make_bus("ledger", concurrency=0) as bus:
        head = await bus.send(Posted(seq="acct", n=0), to="ledger", sequence="acct")
        await bus.send(Posted(seq="acct", n=1), to="ledger", sequence="acct")
        await bus.send(Ping(n=1), to="orders")
    # The head failed for good: the member behind it is ready, but parked.
    await db.execute("UPDATE nmbus.ledger SET subqueue = 'F' WHERE unique_id = $1", head)
    server = await serve("--token", TOKEN)
    browser.get(server.url + "/")
    assert cell(browser, "ledger", "I") == "1"
    assert cell(browser, "ledger", "oldest-ready") == "blocked"
    assert cell(browser, "orders", "oldest-ready").endswith(" s")  # a claimable row: its age
    browser.get(server.url + "/queues/ledger")
    assert browser.find_element("id", "oldest-ready").text == "blocked"
    # Requeued, the head is claimable again: an age, not "blocked".
    await db.execute("UPDATE nmbus.ledger SET subqueue = 'I' WHERE unique_id = $1", head)
    browser.get(server.url + "/")
    assert cell(browser, "ledger", "oldest-ready").endswith(" s")
