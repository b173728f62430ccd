"""``nmbus dashboard`` for real: the command in a process of its own, driven by headless Chromium.

The browser is Debian's chromium through its chromedriver, named explicitly
(Selenium Manager never runs, nothing is downloaded). HTTP checks that need
no browser (refused POSTs, /metrics) use plain urllib against the same server.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import asyncpg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nmbus.sql import render
from tests.ops_data import Facts
from tests.procs import ROOT

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[str]

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, str, Any]:
        req = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, resp.read().decode(), resp.headers
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode(), err.headers

    def post(
        self, path: str, form: dict[str, str], headers: dict[str, str] | None = None
    ) -> tuple[int, str]:
        data = urlencode(form).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=headers or {})
        opener = urllib.request.build_opener(_NoRedirect)
        try:
            with opener.open(req, timeout=30) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def start(dsn: str, *args: str) -> Server:
    port = _free_port()
    cmd = [sys.executable, "-m", "nmbus", "dashboard", "--dsn", dsn, "--port", str(port), *args]
    env = {k: v for k, v in os.environ.items() if k != "NMBUS_DASHBOARD_TOKEN"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    server = Server(f"http://127.0.0.1:{port}", proc)
    for _ in range(300):
        if proc.poll() is not None:
            raise AssertionError(f"dashboard exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if server.get("/healthz")[0] == 200:
                return server
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError("the dashboard did not answer within 30 s")


@pytest.fixture
def serve(dsn: str) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def run(*args: str) -> Server:
        server = start(_with_password(dsn), *args)
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


def wait_until(check: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.1)


def note(browser: Any) -> str:
    """The note of the page a change ended on, once that page has loaded."""
    from selenium.webdriver.common.by import By

    return str(wait_until(lambda: browser.find_elements(By.ID, "note"))[0].text)


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


# -- in the browser ------------------------------------------------------------------------


async def test_queues_page_shows_every_queue_and_its_counts(
    serve: Callable[..., Server], browser: Any, facts: Facts, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    server = serve("--token", TOKEN)
    browser.get(server.url + "/")
    names = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "td.name")]
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


async def test_the_queues_page_refreshes_itself_without_a_reload(
    serve: Callable[..., Server], browser: Any, facts: Facts, db: asyncpg.Connection
) -> None:
    server = serve("--token", TOKEN, "--refresh", "1")
    browser.get(server.url + "/")
    browser.execute_script("window.notReloaded = true;")
    assert cell(browser, "shipping", "I") == "1"
    await db.execute(
        "INSERT INTO nmbus.shipping (from_endpoint, to_endpoint, label, msg_text) "
        "SELECT 'orders', 'shipping', 'x', '{}' FROM generate_series(1, 4)"
    )
    wait_until(lambda: cell(browser, "shipping", "I") == "5")
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
    server = serve("--token", TOKEN)
    browser.get(server.url + "/failed?queue=billing")
    links = browser.find_elements(By.CSS_SELECTOR, "#failed-table a.open")
    assert [int(a.text) for a in links] == facts.failed_ids[::-1]  # newest first
    browser.find_element(By.LINK_TEXT, str(first)).click()
    assert browser.find_element(By.ID, "subqueue").text == "F"
    assert "card declined" in browser.find_element(By.ID, "error").text
    assert '"order_id": 1' in browser.find_element(By.ID, "body").text
    assert '"trace": "t-1"' in browser.find_element(By.ID, "headers").text
    browser.find_element(By.ID, "requeue-one").click()
    assert "1 failed message" in browser.find_element(By.ID, "summary").text
    browser.save_screenshot(str(tmp_path / "confirm.png"))
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.ID, "do-it").click()
    # The click starts a navigation; the page that answers it may not be there yet.
    assert note(browser) == "requeued 1 message"
    row = await db.fetchrow("SELECT subqueue, retry_count FROM nmbus.billing WHERE id = $1", first)
    assert (row["subqueue"], row["retry_count"]) == ("I", 0)
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing WHERE subqueue = 'F'") == 2


async def test_requeue_all_matching_and_purge_with_a_filter(
    serve: Callable[..., Server], browser: Any, facts: Facts, db: asyncpg.Connection
) -> None:
    from selenium.webdriver.common.by import By

    server = serve("--token", TOKEN)
    browser.get(server.url + "/failed?" + urlencode({"error": "DECLINED"}))
    assert len(browser.find_elements(By.CSS_SELECTOR, "#failed-table a.open")) == 2
    browser.find_element(By.ID, "purge-matching").click()
    assert "2 failed messages" in browser.find_element(By.ID, "summary").text
    browser.find_element(By.ID, "token").send_keys("not-the-token!")
    browser.find_element(By.ID, "do-it").click()
    assert "wrong token" in wait_until(lambda: browser.find_elements(By.ID, "message"))[0].text
    assert await db.fetchval("SELECT count(*) FROM nmbus.billing WHERE subqueue = 'F'") == 3
    browser.back()
    token = browser.find_element(By.ID, "token")
    token.clear()
    token.send_keys(TOKEN)
    browser.find_element(By.ID, "do-it").click()
    assert note(browser) == "purged 2 messages"
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
    server = serve("--token", TOKEN)
    for path in ("/failed", f"/failed/billing/{facts.failed_ids[0]}", "/subscriptions"):
        browser.get(server.url + path)
        assert HOSTILE in browser.find_element(By.TAG_NAME, "main").text
        assert browser.execute_script("return window.pwned === undefined;")
        assert not browser.find_elements(By.CSS_SELECTOR, "main script, main img, main b")
    browser.get(server.url + "/")
    names = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "td.name")]
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

    server = serve("--token", TOKEN)
    browser.get(server.url + "/queues/billing")
    bars = browser.find_elements(By.CSS_SELECTOR, "svg.history g")
    assert len(bars) == 60
    drawn = [float(r.get_attribute("height")) for r in bars[-3].find_elements(By.TAG_NAME, "rect")]
    assert max(h for h in [sum(drawn)]) > 0
    assert browser.find_elements(By.CSS_SELECTOR, "svg.history polyline")
    assert "last 5 min" in browser.find_element(By.TAG_NAME, "main").text


async def test_subscriptions_page_marks_expired_rows(
    serve: Callable[..., Server], browser: Any, facts: Facts
) -> None:
    from selenium.webdriver.common.by import By

    server = serve("--token", TOKEN)
    browser.get(server.url + "/subscriptions")
    expired = browser.find_elements(By.CSS_SELECTOR, "#subscriptions tr.expired")
    assert [r.find_elements(By.TAG_NAME, "td")[2].text for r in expired] == ["audit"]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#subscriptions tbody tr")) == 5


# -- HTTP: changes that must be refused ---------------------------------------------------


def _form(server: Server, query: str) -> tuple[dict[str, str], dict[str, str]]:
    """The confirmation form's fields and the cookie it came with."""
    status, html, headers = server.get("/confirm?" + query)
    assert status == 200, html
    cookie = headers["set-cookie"].split(";")[0]
    csrf = html.split('name="csrf" value="')[1].split('"')[0]
    return {"csrf": csrf, "confirm": "yes", "queue": "billing"}, {"Cookie": cookie}


async def test_a_change_without_token_or_csrf_is_refused(
    serve: Callable[..., Server], facts: Facts, db: asyncpg.Connection
) -> None:
    server = serve("--token", TOKEN)
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
    server = serve("--token", TOKEN)
    assert server.get("/")[0] == 200
    assert server.get("/", {"Host": "localhost"})[0] == 200
    assert server.get("/", {"Host": "rebound.example"})[0] == 400
    assert server.get("/metrics", {"Host": "rebound.example:8787"})[0] == 400


async def test_read_only_refuses_every_change(
    serve: Callable[..., Server], facts: Facts, db: asyncpg.Connection
) -> None:
    server = serve("--token", TOKEN, "--read-only")
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


def test_starting_beyond_loopback_without_a_token_fails(dsn: str) -> None:
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
        assert done.returncode == 1
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
    assert short.returncode == 1 and "token is too short" in short.stderr


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
    server = serve("--token", TOKEN)
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
