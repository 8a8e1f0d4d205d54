"""``GET /dashboard`` in a real browser (Debian's headless chromium, driven by Playwright) while
a load runs against the real server: the figures move and agree with /metrics, the page asks
nothing of anyone but its server, the key guards the figures; the router's per-worker view;
and every expression of the Grafana dashboards (deploy/grafana) names a metric the live
server and router export.

A screenshot of the loaded page is saved under the test's tmp dir (its path is printed);
``TOKENMILL_DASHBOARD_SCREENSHOT=docs/dashboard.png`` saves it there instead (the docs' one).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from tests.test_grafana import GRAFANA, exported_names, missing_metrics
from tests.test_server_support import MODEL, free_port, start_server, stop_server

KEY = "dashboard-test-key"
ROUTER_KEY = "router-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT_MARK = "dashboard load"
# what the page may fetch: itself, its script and style, its data; nothing else, anywhere
PAGE_PATHS = {"/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css",
              "/dashboard/data"}


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # ngram speculation, so the spec-decode figures and metrics exist; prompts shown
    s = start_server(tmp_path_factory, "--api-key", KEY, "--speculative-method", "ngram",
                     "--dashboard-show-prompts", "--max-num-seqs", "8")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def router(tmp_path_factory, server):
    """``tokenmill router`` in front of the server, with a key of its own."""
    port = free_port()
    log = (tmp_path_factory.mktemp("router") / "router.log").open("w")
    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_API_KEY"}
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "router", "--worker",
                             server.url, "--port", str(port), "--api-key", ROUTER_KEY,
                             "--worker-api-key", KEY, "--health-check-interval", "0.5"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(url) or proc.poll() is not None, 60, "the router")
        assert proc.poll() is None, f"the router exited: {log.name}"
        yield SimpleNamespace(url=url)
    finally:
        proc.kill()
        proc.wait(10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is a test dependency (pip install -e "
                                          "'.[test]')")
    executable = chromium()
    if executable is None:
        pytest.skip("no chromium: install Debian's package (apt-get install chromium; "
                    "scripts/setup.sh does it when run as root)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable,
                              args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        b.close()


class Load:
    """Completions from ``threads`` threads until stopped: plain prompts (some sharing a
    prefix), and every fourth request a JSON-constrained chat."""

    def __init__(self, url: str, threads: int = 4):
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0,
                                    timeout=60)
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(threads)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)
        assert not self.errors, self.errors

    def _run(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                self._one(i, n)
            except Exception as e:  # the test fails on it at the end
                self.errors.append(e)
                return

    def _one(self, i: int, n: int) -> None:
        if (i + n) % 4 == 0:
            self.client.chat.completions.create(
                model=MODEL, max_tokens=16, response_format={"type": "json_object"},
                messages=[{"role": "user", "content": f"A JSON object about item {n}."}])
            return
        story = "The mill turned all night and the miller counted the sacks one by one. " * 3
        self.client.completions.create(model=MODEL, max_tokens=40 + 8 * i,
                                       prompt=f"{PROMPT_MARK} {story} Thread {i}, story {n}:")


def metrics_text(url: str, headers: dict | None = None) -> str:
    return httpx.get(f"{url}/metrics", headers=headers, timeout=10).text


def sample(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


def wait_for(condition: Callable[[], object], timeout: float = 30.0, what: str = "") -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def figure(page, name: str) -> float | None:
    """A figure's raw number (``data-value``) on the page, or None when absent or empty."""
    value = page.evaluate("""(name) => {
        const el = document.querySelector(`[data-figure="${name}"]`);
        if (!el) return null;
        const v = el.matches('[data-value]') ? el : el.querySelector('[data-value]');
        return v ? v.dataset.value : null; }""", name)
    return float(value) if value not in (None, "") else None


def open_page(browser, origin: str, fragment: str = "") -> tuple[object, list[str]]:
    """A new page on ``origin``'s dashboard; every request it makes is recorded, and any to
    another origin is refused (and still recorded); its script errors are kept in
    ``page.script_errors``."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    requests: list[str] = []

    def guard(route) -> None:
        requests.append(route.request.url)
        same = urlsplit(route.request.url)[:2] == urlsplit(origin)[:2]
        route.continue_() if same else route.abort()

    context.route("**/*", guard)
    page = context.new_page()
    errors: list[object] = []
    page.script_errors = errors
    page.on("pageerror", lambda error: errors.append(error))
    page.goto(f"{origin}/dashboard{fragment}")
    return page, requests


def assert_only_own_requests(page, origin: str, requests: list[str]) -> None:
    """Also: the page's script raised nothing."""
    outside = [u for u in requests if urlsplit(u)[:2] != urlsplit(origin)[:2]]
    assert not outside, f"the page asked other servers: {outside}"
    assert {urlsplit(u).path for u in requests} == PAGE_PATHS
    assert not page.script_errors, page.script_errors


def screenshot(page, tmp_path: Path) -> Path:
    path = Path(os.environ.get("TOKENMILL_DASHBOARD_SCREENSHOT") or tmp_path / "dashboard.png")
    page.screenshot(path=str(path), full_page=True)
    print(f"dashboard screenshot: {path}")
    return path


def rank_bucket(text: str, histogram: str, n: int, q: float) -> tuple[float, float]:
    """The bounds (lower, upper] of the /metrics bucket holding the nearest-rank ``q``
    quantile of ``n`` observations."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets = sorted((float(s.labels["le"]), s.value)
                     for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name == f"{histogram}_bucket")
    rank, lower = max(1, math.ceil(q * n)), 0.0
    for le, cumulative in buckets:
        if cumulative >= rank:
            return lower, le
        lower = le
    raise AssertionError(f"no bucket of {histogram} holds rank {rank}")


# ----- the server's page ------------------------------------------------------------------------

def test_the_page_moves_under_load_and_agrees_with_metrics(server, browser, tmp_path):
    page, requests = open_page(browser, server.url, f"#key={KEY}")
    with Load(server.url):
        wait_for(lambda: (figure(page, "running") or 0) > 0, what="running requests on the page")
        first = wait_for(lambda: figure(page, "total-generation_tokens_total"),
                         what="generated tokens on the page")
        wait_for(lambda: figure(page, "total-generation_tokens_total") > first,
                 what="the generated-token total to move")
        wait_for(lambda: (figure(page, "generation_tps") or 0) > 0, what="generation tok/s")
        wait_for(lambda: PROMPT_MARK in page.inner_text("#requests"), 20, "prompt text")
        shown = figure(page, "total-generation_tokens_total")
        scraped = sample(metrics_text(server.url, AUTH), "tokenmill:generation_tokens_total")
        assert shown <= scraped  # the page's poll came first; counters only grow
        wait_for(lambda: (figure(page, "spec_acceptance") or 0) > 0, what="spec acceptance")
        wait_for(lambda: (figure(page, "structured_share") or 0) > 0, what="structured share")
        screenshot(page, tmp_path)
    assert page.get_attribute("[data-figure=spec_acceptance] .value", "data-value") != ""
    _agrees_when_idle(page, server)
    assert_only_own_requests(page, server.url, requests)
    page.context.close()


def _agrees_when_idle(page, server) -> None:
    """Once the load is over, the page's totals are /metrics' own numbers, and its
    percentiles lie in the /metrics bucket that holds the same rank."""
    def settled() -> str | None:
        text = metrics_text(server.url, AUTH)
        pairs = [(figure(page, "total-generation_tokens_total"),
                  sample(text, "tokenmill:generation_tokens_total")),
                 (figure(page, "total-request_success_total"),
                  sample(text, "tokenmill:request_success_total")),
                 (figure(page, "total-prompt_tokens_total"),
                  sample(text, "tokenmill:prompt_tokens_total")),
                 (figure(page, "ttft-n"),
                  sample(text, "tokenmill:time_to_first_token_seconds_count")),
                 (figure(page, "running"), 0.0), (figure(page, "waiting"), 0.0)]
        return text if all(a == b for a, b in pairs) else None

    text = wait_for(settled, 15, "the page's totals to equal /metrics' once idle")
    for key, histogram in (("ttft", "time_to_first_token_seconds"),
                           ("e2e", "e2e_request_latency_seconds")):
        n = int(figure(page, f"{key}-n"))
        for q in (0.5, 0.99):
            lower, upper = rank_bucket(text, f"tokenmill:{histogram}", n, q)
            assert lower < figure(page, f"{key}-p{round(q * 100)}") <= upper, (key, q)


def test_the_api_key_guards_the_figures(server, browser):
    assert httpx.get(f"{server.url}/dashboard/data", timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/dashboard/data", headers=AUTH, timeout=10).status_code == 200
    shell = httpx.get(f"{server.url}/dashboard", timeout=10)  # code and style only: public
    assert shell.status_code == 200 and "default-src 'none'" in shell.headers[
        "content-security-policy"]
    page, requests = open_page(browser, server.url)
    page.wait_for_selector("#auth", state="visible")
    assert page.is_hidden("#main") and figure(page, "running") is None
    page.fill("#auth-key", "wrong")
    page.click("#auth-form button")
    wait_for(lambda: page.inner_text("#auth-error"), 10, "the wrong key refused")
    page.fill("#auth-key", KEY)
    page.click("#auth-form button")
    page.wait_for_selector("#main", state="visible")
    wait_for(lambda: figure(page, "running") is not None, 10, "figures after the key")
    assert_only_own_requests(page, server.url, requests)
    page.context.close()


# ----- the router's per-worker view ---------------------------------------------------------------

def test_the_router_shows_each_worker(server, router, browser):
    assert httpx.get(f"{router.url}/dashboard/data", timeout=10).status_code == 401
    page, requests = open_page(browser, router.url, f"#key={ROUTER_KEY}")
    row = f'#workers tr[data-worker="{server.url}"]'
    page.wait_for_selector(row)
    wait_for(lambda: page.inner_text(f"{row} td:nth-child(2)") == "yes", 10, "a healthy worker")
    data = httpx.get(f"{router.url}/dashboard/data", timeout=10,
                     headers={"Authorization": f"Bearer {ROUTER_KEY}"}).json()
    (worker,) = data["workers"]
    assert worker["url"] == server.url and worker["error"] is None
    assert worker["data"]["kind"] == "server" and worker["data"]["model"] == MODEL
    assert page.inner_text("#title") == "tokenmill router"
    assert_only_own_requests(page, router.url, requests)
    page.context.close()


# ----- Grafana against live /metrics ----------------------------------------------------------

def test_grafana_expressions_name_live_metrics(server, router):
    """After the load above (or without it: every family is exported from the start)."""
    live = exported_names(metrics_text(server.url, AUTH))
    assert missing_metrics(GRAFANA / "tokenmill.json", live) == []
    routed = exported_names(metrics_text(router.url))
    assert missing_metrics(GRAFANA / "tokenmill-router.json", routed) == []
