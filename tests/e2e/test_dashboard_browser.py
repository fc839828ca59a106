"""The dashboard in a real headless Chromium (Debian's `chromium`, driven by Playwright)
against a real controller with two services: the login page without a session, the login
link of `fleetserve dashboard`, no console error, the services as `status -o json` shows
them, a replica killed by the test shown replaced within seconds, charts with data points.
Screenshots go to $FLEETSERVE_TEST_ARTIFACTS (default: test-artifacts/ in the checkout)."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import signal
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, sync_playwright

from fleetserve.api.models import ServiceInfo
from tests.e2e.conftest import Fleet, endpoint_of

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(
    os.environ.get("FLEETSERVE_TEST_ARTIFACTS")
    or Path(__file__).resolve().parents[2] / "test-artifacts"
)
SERVICE = """\
name: {name}
service:
  readiness_probe: /health
  replicas: 2
workdir: {workdir}
run: python3 server.py
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert Path(CHROMIUM).exists(), "the browser tests need Debian's chromium (.ci/run installs it)"
    with sync_playwright() as pw:
        b = pw.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",  # root in CI
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",  # this machine has no internet
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        yield b
        b.close()


def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"dashboard-{name}.png"), full_page=True)


def watch_console(page: Page) -> list[str]:
    problems: list[str] = []

    def on_console(msg: ConsoleMessage) -> None:
        if msg.type == "error":
            problems.append(f"console: {msg.text}")

    page.on("console", on_console)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    return problems


def until(what: str, check: Callable[[], bool], timeout: float = 30) -> None:
    """Poll the page from here: the dashboard's CSP refuses the eval that Playwright's
    wait_for_function needs (as it should)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def load(url: str, stop: threading.Event, seconds: float = 60, limit: int = 3000) -> None:
    """Bounded traffic to the endpoint: at most `limit` requests or `seconds`."""
    deadline = time.monotonic() + seconds
    for _ in range(limit):
        if stop.is_set() or time.monotonic() > deadline:
            return
        try:
            with urllib.request.urlopen(url + "/x", timeout=5) as r:
                r.read()
        except OSError:
            pass
        time.sleep(0.02)


def _ticks(page: Page, chart: str) -> list[float]:
    return [
        float(t)
        for t in page.locator(f"[data-chart={chart}] text[data-tick]").evaluate_all(
            "ts => ts.map(t => t.dataset.tick)"
        )
    ]


def round_step(ticks: list[float]) -> bool:
    """Ticks from 0 in equal steps of 1, 2 or 5 times a power of ten."""
    steps = {round(b - a, 9) for a, b in itertools.pairwise(ticks)}
    if ticks[:1] != [0] or len(steps) != 1:
        return False
    (step,) = steps
    mantissa = step / 10 ** math.floor(math.log10(step))
    return any(abs(mantissa - m) < 1e-6 for m in (1, 2, 5))


def check_service_page(page: Page, svc: ServiceInfo, ended: int) -> None:
    """A service page after one of its replicas ended: legends name the live replicas only
    (the ended ones grey under one entry), in distinct colours; round axis ticks (whole for
    counts), latency on a log axis, the dashed target drawn over READY; 24-hour event times;
    each replica's log one click away; an events filter that holds across polls."""
    live = sorted(r.replica_id for r in svc.replicas if r.terminated_at is None)
    until("a replica's own points", lambda: page.locator("[data-chart=rps] polyline").count() >= 2)
    legend = page.locator("[data-chart=rps] .legend span")
    names = legend.evaluate_all("xs => xs.map(x => x.dataset.series)")
    colors = legend.evaluate_all("xs => xs.map(x => x.dataset.color)")
    replicas = sorted(int(n.split()[1]) for n in names if n.startswith("replica "))
    assert set(replicas) <= set(live) and f"replica {ended}" not in names, names
    assert len(set(colors)) == len(colors), (names, colors)
    for chart in ("rps", "errors", "scale", "inflight"):
        ticks = _ticks(page, chart)
        if ticks:
            assert round_step(ticks), (chart, ticks)
    for chart in ("scale", "inflight"):
        assert all(t == int(t) for t in _ticks(page, chart)), chart
    assert page.locator("[data-chart=latency]").get_attribute("data-scale") == "log"
    latency = _ticks(page, "latency")
    assert latency and all(math.log10(t) == round(math.log10(t)) for t in latency), latency
    scale_lines = page.locator("[data-chart=scale] polyline")
    last = scale_lines.nth(scale_lines.count() - 1)
    assert last.get_attribute("data-series") == "target" and last.get_attribute("stroke-dasharray")
    times = page.locator("table.events tbody tr td:first-child").all_inner_texts()
    assert times and all(re.fullmatch(r"\d\d:\d\d:\d\d", t) for t in times), times[:3]
    # the log link of a live replica: its own output, read with the page's session
    link = page.locator(f"a[data-log='{live[0]}']")
    assert link.get_attribute("target") == "_blank"
    href = link.get_attribute("href") or ""
    log = page.request.get(urllib.parse.urljoin(page.url, href))
    assert log.status == 200 and f"log-of-replica-{live[0]}" in log.text(), log.text()[-300:]
    # the events filter: rows holding what is typed, still so after the next polls
    rows = page.locator("table.events tbody tr")
    total = rows.count()
    page.fill("#event-filter", "ready")
    until("the filter applied", lambda: 0 < rows.count() < total)
    time.sleep(2.5)  # a poll re-renders the page
    assert page.input_value("#event-filter") == "ready"
    texts = rows.all_inner_texts()
    assert texts and all("ready" in t.lower() for t in texts) and len(texts) < total
    page.fill("#event-filter", "")
    until("every event back", lambda: rows.count() >= total)


def check_narrow(page: Page) -> None:
    """At 420 px the page scrolls its tables, never itself (it was 689 px wide)."""
    page.set_viewport_size({"width": 420, "height": 900})
    try:
        width = page.evaluate("() => document.documentElement.scrollWidth")
        assert width <= 420, width
        shot(page, "narrow")
    finally:
        page.set_viewport_size({"width": 1280, "height": 900})


def test_dashboard_in_a_real_browser(fleet: Fleet, browser: Browser) -> None:
    fleet.env["FLEETSERVE_HISTORY_STEP"] = "1"  # a chart point a second
    endpoints = {}
    for name in ("alpha", "beta"):
        text = SERVICE.format(name=name, workdir=fleet.workdir)
        if name == "alpha":  # a line in each replica's log, for the page's log links
            text = text.replace("run: ", "run: echo log-of-replica-$FLEETSERVE_REPLICA_ID; ")
        path = fleet.write_service(name, text)
        endpoints[name] = endpoint_of(fleet.cli("up", str(path), timeout=120).stdout)
    # gamma scales to zero and has no replica: its page shows no empty version table
    zero = SERVICE.format(name="gamma", workdir=fleet.workdir).replace(
        "replicas: 2",
        "replica_policy: {min_replicas: 0, max_replicas: 1, target_qps_per_replica: 1}",
    )
    fleet.cli("up", "--detach", str(fleet.write_service("gamma", zero)), timeout=120)
    client = fleet.client()
    fleet.wait_for(
        "both services READY with 2 replicas",
        lambda: all(
            sum(r.status == "READY" for r in client.service(n).replicas) == 2 for n in endpoints
        ),
    )
    base = client.url
    stop = threading.Event()
    traffic = threading.Thread(target=load, args=(endpoints["alpha"], stop), daemon=True)
    traffic.start()
    context = browser.new_context(locale="en-US")  # 12-hour by default: the page must not
    page = context.new_page()
    problems = watch_console(page)
    try:
        # No session: the login page, and the API refuses the browser.
        page.goto(base + "/")
        page.wait_for_url(re.compile(r"/login$"))
        assert page.locator("#login-form").is_visible()
        shot(page, "login")
        assert page.request.get(base + "/api/v1/services").status == 401
        # A wrong token is refused, on the page.
        page.fill("#token", "not-the-token")
        page.click("button[type=submit]")
        until("the login error", lambda: page.inner_text("#login-error") != "")
        assert "not this controller's token" in page.inner_text("#login-error")
        problems.clear()  # the 401 of that wrong token is logged by the browser as an error

        # The login link: one-time code in the fragment, gone from the address bar after.
        link = fleet.cli("dashboard").stdout.split()[-1]
        assert "#code=" in link and (fleet.home / "api-token").read_text().strip() not in link
        page.goto(link)
        page.wait_for_url(base + "/")
        assert "code=" not in page.url
        page.wait_for_selector("table.services tr[data-service=beta]")
        cookie = next(c for c in context.cookies() if c["name"] == "fleetserve_session")
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert (fleet.home / "api-token").read_text().strip() not in cookie["value"]
        # The link worked once: a second browser with it is not logged in.
        other = browser.new_context().new_page()
        other.goto(link)
        until("the login error", lambda: other.inner_text("#login-error") != "")
        assert "used or expired" in other.inner_text("#login-error")
        other.context.close()

        # What the page shows is what `status -o json` shows.
        status = json.loads(fleet.cli("status", "-o", "json").stdout)
        for svc in status:
            row = page.locator(f"tr[data-service={svc['name']}]")
            ready = sum(r["status"] == "READY" for r in svc["replicas"])
            cell = row.locator("[data-ready]")
            until(
                f"{svc['name']} shown {ready} READY",
                lambda c=cell, n=ready: c.get_attribute("data-ready") == str(n),
            )
            assert svc["status"] in row.inner_text()
            assert f"{ready}/{svc['target_replicas']}" in row.inner_text()
        shot(page, "services")

        # One service's page: its replicas, charts with data.
        page.click("a[href='#/service/alpha']")
        page.wait_for_selector("table.replicas tr[data-replica]")
        shown = {
            int(x)
            for x in page.locator("table.replicas tr[data-replica]").evaluate_all(
                "rows => rows.map(r => r.dataset.replica)"
            )
        }
        live = {r.replica_id for r in client.service("alpha").replicas if r.terminated_at is None}
        assert shown == live

        def points(chart: str) -> int:
            return int(page.locator(f"[data-chart={chart}]").get_attribute("data-points") or 0)

        until("3 request-rate points", lambda: points("rps") >= 3)
        until("a latency point", lambda: points("latency") >= 1)
        assert page.locator("[data-chart=rps] polyline").count() >= 1
        assert page.locator("[data-chart=scale] polyline").count() >= 1
        shot(page, "service")

        # kill -9 a replica behind the controller's back: shown replaced within seconds.
        victim = next(r for r in client.service("alpha").replicas if r.status == "READY")
        assert victim.pid is not None
        os.killpg(victim.pid, signal.SIGKILL)
        t0 = time.monotonic()
        gone = page.locator(f"table.replicas tr[data-replica='{victim.replica_id}']")
        until("the killed replica off the page", lambda: gone.count() == 0, timeout=20)
        until(
            "2 READY replicas on the page again",
            lambda: (
                page.locator("table.replicas [data-status=READY]").count() == 2
                and gone.count() == 0
            ),
            timeout=40,
        )
        replaced_in = time.monotonic() - t0
        assert replaced_in < 40
        events = page.locator("table.events").inner_text()
        assert "PREEMPTED" in events or "FAILED" in events
        shot(page, "replaced")
        check_service_page(page, client.service("alpha"), victim.replica_id)
        check_narrow(page)

        # A service at zero replicas: no "Version 1 serves" table with nothing in it.
        page.click("a[href='#/']")
        page.click("a[href='#/service/gamma']")
        until("gamma's page", lambda: "No replica right now." in page.inner_text("main"))
        assert page.locator("#rollout").count() == 0
        shot(page, "zero")

        # Scaled and rolled out: beta to 3 replicas in a new version that starts slowly
        # enough for the page to show both versions side by side.
        page.click("a[href='#/']")
        page.click("a[href='#/service/beta']")
        page.wait_for_selector("table.replicas tr[data-replica]")
        slower = (
            SERVICE.format(name="beta", workdir=fleet.workdir)
            .replace("replicas: 2", "replicas: 3")
            .replace("run: python3 server.py", "run: sleep 3; python3 server.py")
        )
        # In the background: `update` follows the rollout, and the page is watched meanwhile.
        update = fleet.cli_background("update", "beta", str(fleet.write_service("beta-v2", slower)))
        versions = page.locator("#rollout tr[data-version]")
        until(
            "both versions in the rollout table",
            lambda: (
                versions.count() == 2 and "Rolling out version 2" in page.inner_text("#rollout")
            ),
        )
        shot(page, "rollout")
        assert update.wait(timeout=120) == 0
        until(
            "3 READY replicas of version 2, version 1 gone",
            lambda: (
                page.locator("table.replicas [data-status=READY]").count() == 3
                and versions.count() == 1
                and versions.first.get_attribute("data-version") == "2"
            ),
            timeout=90,
        )
        page.click("a[href='#/']")
        beta_ready = page.locator("tr[data-service=beta] [data-ready]")
        until("the list showing beta at 3/3", lambda: beta_ready.get_attribute("data-ready") == "3")
        assert "3/3" in page.locator("tr[data-service=beta]").inner_text()
        assert problems == [], problems
    finally:
        shot(page, "last")  # what the page showed at the end (or when a check failed)
        print("browser problems:", problems)
        stop.set()
        traffic.join(timeout=10)
        context.close()
    print(f"replica {victim.replica_id} killed: shown replaced after {replaced_in:.1f} s")
