"""The dashboard in a real browser (Playwright driving Debian's Chromium) against a real 3-node
`mutexcron run` cluster, on SQLite and PostgreSQL: every page renders; a takeover shows in the
event feed within one refresh, with no missed-run alarm while the new holder catches up inside the
grace; a failed run's and a failed task's tracebacks on their pages; pause, resume and trigger
work from the page; a shared job is paused, resumed, run now and removed from the Shared jobs page;
failed tasks are retried from the page (one, then a confirmed bulk) and then run; the token is
checked as it is entered; a request without it changes nothing; no page shows the password of
the store URL. A second test: 500 locks rendered, every page at a 390 px viewport without a
page-level horizontal scroll, and axe-core (its npm package, injected) finds no serious or
critical accessibility violation on any page.

With MUTEXCRON_UPDATE_SCREENSHOTS=1, the PostgreSQL run also writes docs/images/dashboard-*.png.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from mutexcron.guard.triggers import is_trigger_code
from mutexcron.locks import Node, lock_store_from_url
from mutexcron.observability.feed.writer import FLUSH_EVERY
from mutexcron.tasks import task_store_from_url
from tests.backends import backend_params_full_matrix, drop_store_tables, require_server

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "tests" / "nodes" / "dashboard_jobs.py"
CHROMIUM = "/usr/bin/chromium"
TOKEN = "browser-test-action-token-0123"
SECRET = "pw-S3cret-browser"
REFRESH = 1.0
LEASE = 5.0  # the jobs file's unactive_interval for billing
#: A change in the store is on an open page within one refresh, plus the snapshot the dashboard
#: shares between pages (half a refresh) and the request, with room for a loaded machine.
SHOWN_WITHIN = 2 * REFRESH + 1.0
#: An event reaches the store's feed within the node's flush (observability/feed/writer.py).
FEED_FLUSH = FLUSH_EVERY + 1.0
SCREENSHOTS = ROOT / "docs" / "images"


def _need(what: str, fix: str) -> None:
    message = f"{what} is not available: {fix}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message} (CI=true: .ci/run installs it)")
    pytest.skip(message)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need("playwright", 'pip install -e ".[test]"')
    if not Path(CHROMIUM).exists():
        _need(CHROMIUM, "apt-get install chromium")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


@dataclass
class Cluster:
    kind: str
    url: str
    dir: Path
    env: dict[str, str]
    nodes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    dashboard: subprocess.Popen[bytes] | None = None
    base: str = ""

    def lock(self, name: str) -> Any:
        store = lock_store_from_url(self.url)
        try:
            return store.read(name)
        finally:
            store.close()

    def tasks(self, **where: Any) -> list[Any]:
        store = task_store_from_url(lock_store_from_url(self.url).url)
        try:
            return store.list(**where)
        finally:
            store.close()

    def add_tasks(self, code: str, keys: list[str], due: timedelta = timedelta(0)) -> None:
        store = task_store_from_url(lock_store_from_url(self.url).url)
        try:
            for key in keys:
                store.add(code, key, due)
        finally:
            store.close()


def _url(kind: str) -> str:
    suffix = f"b{os.getpid()}"
    base = require_server("postgresql").replace("postgres@", f"postgres:{SECRET}@", 1)
    return f"{base}?table=dash_{suffix}&tasks_table=dash_tasks_{suffix}"


def _wait(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout}s")


def _log_tails(directory: Path, lines: int = 60) -> str:
    """The end of every node's and the dashboard's log, for a failure's report."""
    parts = []
    for log in sorted(directory.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log} (last {len(tail)} lines) ---\n" + "\n".join(tail))
    return "\n".join(parts)


@pytest.fixture(params=backend_params_full_matrix(("sqlite",), ("postgresql",)))  # PostgreSQL: the 500 locks test
def cluster(request: pytest.FixtureRequest, tmp_path: Path, browser: Any) -> Iterator[Cluster]:
    kind = request.param
    failed_before = request.session.testsfailed
    url = f"sqlite:///{tmp_path}/cluster.db" if kind == "sqlite" else _url(kind)
    if kind != "sqlite":
        drop_store_tables(url)
    jobstore_url = f"sqlite:///{tmp_path}/jobs.db" if kind == "sqlite" else _jobstore_url(url)
    jobstore_table = f"dash_jobs_b{os.getpid()}"
    env = {**os.environ, "MUTEXCRON_LOCK_URL": url, "DASH_DIR": str(tmp_path), "MUTEXCRON_DASHBOARD_TOKEN": TOKEN,
           "PYTHONPATH": str(ROOT), "DASH_JOBSTORE_URL": jobstore_url, "DASH_JOBSTORE_TABLE": jobstore_table}  # fmt: skip
    env.pop("MUTEXCRON_UPDATE_SCREENSHOTS", None)
    found = Cluster(kind, url, tmp_path, env)
    command = [sys.executable, "-m", "mutexcron"]
    try:
        for i in range(3):
            log = open(tmp_path / f"n{i}.log", "wb")
            found.nodes[f"n{i}"] = subprocess.Popen([*command, "run", str(JOBS), "--node-id", f"n{i}"], cwd=tmp_path, env=env,
                                                    stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        _wait(lambda: (found.lock("billing") or None) and found.lock("reports"), 30, "the nodes took the locks")
        dash_log = tmp_path / "dashboard.log"
        serve = [*command, "dashboard", "--jobs", str(JOBS), "--port", "0", "--refresh", str(REFRESH)]
        found.dashboard = subprocess.Popen(serve, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=open(dash_log, "wb"))
        started = re.compile(r"mutexcron dashboard: (http://\S+)/")
        line = _wait(lambda: started.search(dash_log.read_text()), 30, "the dashboard started")
        found.base = line.group(1)
        yield found
    finally:
        for process in [*found.nodes.values(), *([found.dashboard] if found.dashboard else [])]:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in [*found.nodes.values(), *([found.dashboard] if found.dashboard else [])]:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        if request.session.testsfailed > failed_before:  # the call failed: shown as this teardown's output
            print(_log_tails(tmp_path))
        if kind != "sqlite":
            drop_store_tables(url)
            _drop_job_table(jobstore_url, jobstore_table)


def _jobstore_url(url: str) -> str:
    """The shared job store on the same PostgreSQL (its psycopg 3 driver: LISTEN/NOTIFY)."""
    return "postgresql+psycopg://" + url.split("://", 1)[1].partition("?")[0]


def _drop_job_table(url: str, table: str) -> None:
    import sqlalchemy

    engine = sqlalchemy.create_engine(url)
    try:
        with engine.begin() as conn:
            for name in (table, f"{table}_changes"):
                conn.execute(sqlalchemy.text(f"DROP TABLE IF EXISTS {name}"))
    finally:
        engine.dispose()


def _shoot(page: Any, cluster: Cluster, name: str) -> None:
    if os.environ.get("MUTEXCRON_UPDATE_SCREENSHOTS") == "1" and cluster.kind == "postgresql":
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"dashboard-{name}.png"), full_page=True)


def test_the_dashboard_in_a_browser_against_a_3_node_cluster(cluster: Cluster, browser: Any) -> None:
    from playwright.sync_api import expect

    # Failed tasks to retry: the handler fails until $DASH_DIR/smtp-up exists (2 attempts).
    keys = [f"order-{i}" for i in range(1, 5)]
    cluster.add_tasks("email.send", keys)
    _wait(lambda: len(cluster.tasks(state="failed")) == 4, 30, "the tasks failed")
    _wait(lambda: len(lock_store_from_url(cluster.url).history("billing")) >= 12, 60, "runs were recorded")

    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("dialog", lambda dialog: dialog.accept())
    pages: dict[str, str] = {}

    # -- every page renders -----------------------------------------------------------------------
    for name, path, text in [
        ("overview", "/", "n1"),
        ("locks", "/locks", "close_invoices"),
        ("lock", "/lock?name=billing", "send_reminders"),
        ("tasks", "/tasks", "4 tasks match"),
        ("history", "/history", "send_reminders"),
        ("job", "/history?lock=billing&job=send_reminders", "send_reminders"),
        ("task", "/task?code=email.send&key=order-1", "SMTP connection refused"),
        ("shared", "/shared", "weekly_digest"),
    ]:
        page.goto(cluster.base + path)
        expect(page.locator("main")).to_contain_text(text, timeout=10_000)
        page.wait_for_timeout(int(REFRESH * 1500))  # one refresh in place
        expect(page.locator("#stamp")).not_to_have_class(re.compile("stale"))
        pages[name] = page.content()
        _shoot(page, cluster, name)
    assert "<svg" in pages["lock"] and "<svg" in pages["job"] and "<svg" in pages["tasks"]
    assert not errors, errors

    # -- why it failed: a failed run's and a failed task's traceback, folded on their pages --------
    page.goto(cluster.base + "/history?lock=billing&job=send_reminders&outcome=error")
    failed = page.locator("details.error", has_text="SMTP 451").first
    expect(failed).to_be_visible(timeout=30_000)
    expect(failed.locator("pre")).to_be_hidden()  # folded
    failed.locator("summary").click()
    expect(failed.locator("pre")).to_contain_text("Traceback (most recent call last)")
    expect(failed.locator("pre")).to_contain_text("in send_reminders")
    _shoot(page, cluster, "job")
    page.goto(cluster.base + "/task?code=email.send&key=order-1")
    attempts = page.locator("table.attempts")
    expect(attempts.locator("tbody tr")).to_have_count(2, timeout=10_000)  # attempt 1 retried, attempt 2 failed for good
    attempt = attempts.locator("details.error").last
    attempt.locator("summary").click()
    expect(attempt.locator("pre")).to_contain_text("ConnectionRefusedError: SMTP connection refused by mail.example.com:25")
    expect(attempt.locator("pre")).to_contain_text("in send_email")
    _shoot(page, cluster, "task")

    # -- no page shows the password of the store URL ------------------------------------------------
    for path in ("/api/status", "/api/sections/overview", "/api/sections/locks", "/api/sections/tasks"):
        pages[path] = page.request.get(cluster.base + path).text()
    if SECRET in cluster.url:
        assert all(SECRET not in body for body in pages.values())
        assert "postgres:***@" in pages["overview"]

    # -- a request without the token changes nothing ------------------------------------------------
    page.goto(cluster.base + "/lock?name=billing")
    csrf = page.locator('meta[name="mc-csrf"]').get_attribute("content")
    refused = page.request.post(cluster.base + "/api/actions/pause", data=json.dumps({"lock": "billing"}),
                                headers={"Content-Type": "application/json", "X-CSRF-Token": csrf or ""})  # fmt: skip
    assert refused.status == 403 and "action token" in refused.json()["error"]
    page.locator('.card[data-lock="billing"] button[data-action="pause"]').click()  # no token typed in yet
    expect(page.locator("#flash")).to_contain_text("missing or wrong action token")
    assert not cluster.lock("billing").paused
    assert errors == ["Failed to load resource: the server responded with a status of 403 (Forbidden)"]
    errors.clear()

    # -- the token is checked as it is entered: a wrong one is said at once, before any action ------
    page.fill("#token-name", "tester")
    page.fill("#token-value", "a-wrong-token-of-enough-length")
    page.click("#token button")
    expect(page.locator("#token-state")).to_contain_text("token refused: missing or wrong action token")
    assert errors == ["Failed to load resource: the server responded with a status of 403 (Forbidden)"]
    errors.clear()

    # -- pause, resume and trigger from the page ----------------------------------------------------
    page.fill("#token-value", TOKEN)
    page.click("#token button")
    expect(page.locator("#token-state")).to_contain_text("token accepted: actions as tester")
    billing = page.locator('.card[data-lock="billing"]')
    billing.locator('button[data-action="pause"]').click()
    expect(billing).to_contain_text("paused by tester (dashboard, 127.0.0.1)", timeout=10_000)
    record = cluster.lock("billing")
    assert record.paused and record.paused_by == "tester (dashboard, 127.0.0.1)"
    billing.locator('button[data-action="resume"]').last.click()  # resume + catch up
    expect(billing.locator(".badge.warn")).to_have_count(0, timeout=10_000)
    assert not cluster.lock("billing").paused
    page.goto(cluster.base + "/lock?name=reports")
    reports = page.locator('.card[data-lock="reports"]')
    reports.locator('button[data-action="trigger"]').click()
    expect(reports.locator(".outcome")).to_contain_text("ran: success", timeout=60_000)
    assert len((cluster.dir / "reports.log").read_text().splitlines()) == 1

    # -- failed tasks are retried from the page and then run --------------------------------------
    # The email tasks only: the resume's catch-up requests are tasks too, and send_reminders' run
    # fails at random, which fails its request (kept as a failed task, as any failed trigger is).
    (cluster.dir / "smtp-up").write_text("")
    page.goto(cluster.base + "/tasks?code=email.send")
    first = page.locator("tr", has_text="email.send/order-1")
    first.locator('button[data-action="retry"]').click()
    expect(page.locator("#s-selection")).to_contain_text("3 tasks match", timeout=15_000)
    _wait(lambda: "order-1" in (cluster.dir / "emails.log").read_text() if (cluster.dir / "emails.log").exists() else False,
          30, "order-1 ran")  # fmt: skip
    page.locator('button[data-action="bulk"]', has_text="Retry 3").click()
    expect(page.locator("#flash")).to_contain_text("3 retried, 0 skipped", timeout=10_000)
    expect(page.locator("#s-selection")).to_contain_text("0 tasks match", timeout=15_000)
    _wait(lambda: sorted((cluster.dir / "emails.log").read_text().split()) == keys, 30, "every retried task ran")
    assert cluster.tasks() == [] or all(is_trigger_code(t.code) for t in cluster.tasks())

    # -- shared jobs: pause, resume, run now and remove from the page ------------------------------
    page.goto(cluster.base + "/shared")
    digest = page.locator("#s-shared tr", has_text="weekly_digest")
    expect(digest).to_contain_text("cron[day_of_week='mon', hour='6']")
    expect(digest).to_contain_text(re.compile(r"n[012]"), timeout=10_000)  # its holder
    digest.locator('button[data-action="job_pause"]').click()
    expect(digest.locator('button[data-action="job_resume"]')).to_be_visible(timeout=10_000)
    expect(digest).to_contain_text("paused")
    digest.locator('button[data-action="job_resume"]').click()
    expect(digest.locator('button[data-action="job_pause"]')).to_be_visible(timeout=10_000)
    digest.locator('button[data-action="trigger"]').click()
    expect(digest.locator(".outcome")).to_contain_text("ran: success", timeout=60_000)
    # purge_sessions may run on its own meanwhile: every 30 minutes, anchored at the epoch (:00, :30)
    assert [j for j in (cluster.dir / "shared.log").read_text().split() if j == "weekly_digest"] == ["weekly_digest"]
    expect(digest).to_contain_text("success", timeout=10_000)  # the run in its row's last run, at a refresh
    _shoot(page, cluster, "shared")
    page.locator("#s-shared tr", has_text="purge_sessions").locator('button[data-action="job_remove"]').click()
    expect(page.locator("#s-shared")).not_to_contain_text("purge_sessions", timeout=10_000)

    # -- a takeover shows in the event feed within one refresh, without a reload, and no missed-run
    # alarm while the new holder catches the fire times up inside their grace (2 x the lease) -----
    page.goto(cluster.base + "/")
    page.evaluate("window.notReloaded = true")
    holder = cluster.lock("billing").holder
    cluster.nodes[holder].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    alarms: list[str] = []

    def taken_over() -> str | None:
        alarms.append(page.locator("#s-alarms").inner_text())  # watched all along the takeover
        record = cluster.lock("billing")
        return record.holder if record is not None and record.holder not in (None, holder) and record.state == "active" else None

    new = _wait(taken_over, 3 * LEASE + 10, "another node took billing over")
    in_store = time.monotonic()
    took = f"{new} took over lock billing"
    feed = page.locator("#s-events")
    while time.monotonic() - in_store < SHOWN_WITHIN + FEED_FLUSH and took not in feed.inner_text():
        alarms.append(page.locator("#s-alarms").inner_text())
        page.wait_for_timeout(100)
    on_page = time.monotonic()
    expect(feed).to_contain_text(took, timeout=1)
    expect(feed).to_contain_text(f"from {holder}, whose heartbeat was")  # the old holder's age
    expect(page.locator("#s-nodes tr", has_text=new).locator(".held")).to_contain_text("billing")
    expect(page.locator("#s-nodes tr", has_text=holder)).to_contain_text("lost")
    assert page.evaluate("window.notReloaded") is True
    assert on_page - in_store <= SHOWN_WITHIN + FEED_FLUSH, f"in the feed {on_page - in_store:.1f}s after the store had it"
    for _ in range(int(2 * LEASE / 0.2)):  # through the rest of the grace
        alarms.append(page.locator("#s-alarms").inner_text())
        page.wait_for_timeout(200)
    assert not [a for a in alarms if "missed-run" in a], [a for a in alarms if "missed-run" in a][:1]
    print(f"takeover: in the store {in_store - killed:.1f}s after the kill, in the feed {on_page - in_store:.1f}s later; "
          f"{len(alarms)} looks at the alarms, none a missed run")  # fmt: skip
    _shoot(page, cluster, "overview")
    # -- tasks cancelled from the page are charted as cancelled, not finished ----------------------
    cluster.add_tasks("email.send", ["later-1", "later-2"], due=timedelta(hours=1))
    page.goto(cluster.base + "/tasks?code=email.send&state=queued")
    expect(page.locator("#s-selection")).to_contain_text("2 tasks match", timeout=15_000)
    page.locator('button[data-action="bulk"]', has_text="Cancel 2").click()
    expect(page.locator("#flash")).to_contain_text("2 cancelled, 0 skipped", timeout=10_000)
    page.goto(cluster.base + "/tasks?code=email.send&state=any")  # its throughput chart read again since the action
    page.wait_for_timeout(int(REFRESH * 1500))
    chart = page.locator("#s-codes svg", has_text="email.send: finished and cancelled per minute")
    expect(chart).to_contain_text(f"{len(keys)} finished, 2 cancelled", timeout=15_000)
    _shoot(page, cluster, "tasks")
    assert not errors, errors
    context.close()


def _axe_source() -> Path:
    """axe-core's ``axe.min.js`` from its npm package, installed once in a temp dir (``npm install axe-core``)."""
    where = Path(os.environ.get("MUTEXCRON_AXE_DIR", Path(tempfile.gettempdir()) / "mutexcron-axe"))
    script = where / "node_modules" / "axe-core" / "axe.min.js"
    if not script.exists():
        if shutil.which("npm") is None:
            _need("npm", "apt-get install npm (the axe-core package is installed with it)")
        where.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(where), "axe-core"],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        if done.returncode != 0 or not script.exists():
            _need("axe-core", f"npm install axe-core failed: {done.stderr[-500:]}")
    return script


def _serious_violations(page: Any, axe: Path) -> list[str]:
    page.add_script_tag(path=str(axe))
    found = page.evaluate(
        "async () => (await axe.run(document, {resultTypes: ['violations']})).violations"
        ".filter(v => v.impact === 'serious' || v.impact === 'critical')"
        ".map(v => `${v.impact} ${v.id}: ${v.help} (${v.nodes.map(n => n.target.join(' ')).slice(0, 3).join(', ')})`)"
    )
    return list(found)


@pytest.mark.parametrize("cluster", backend_params_full_matrix(("postgresql",), ("sqlite",)), indirect=True)
def test_500_locks_every_page_at_390_px_and_no_serious_accessibility_violation(cluster: Cluster, browser: Any) -> None:
    from playwright.sync_api import expect

    axe = _axe_source()
    cluster.add_tasks("email.send", ["order-1"])
    _wait(lambda: cluster.tasks(state="failed"), 30, "the task failed")
    _wait(lambda: len(lock_store_from_url(cluster.url).history("billing")) >= 6, 60, "runs were recorded")
    store = lock_store_from_url(cluster.url)
    try:  # 500 more locks, taken and released by a node that is gone: every one a row of the Locks table
        ghost = Node("ghost:1:aa", "10.0.0.99")
        for i in range(500):
            got = store.acquire_or_renew(f"bulk-{i:03d}", ghost, ttl=30)
            store.release(f"bulk-{i:03d}", ghost, got.token)
        count = len(store.list())  # the 500, the jobs file's and the shared jobs' locks
    finally:
        store.close()
    assert count >= 502
    # bypass_csp: the page's policy forbids inline scripts, axe-core is injected as one
    context = browser.new_context(viewport={"width": 390, "height": 844}, bypass_csp=True)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(cluster.base + "/locks")
    expect(page.locator("#s-locks tbody tr")).to_have_count(count, timeout=15_000)
    sections = page.request.get(cluster.base + "/api/sections/locks").json()
    print(f"500 locks: {sections['calls']} store calls, {sections['store_ms']} ms of store time for a refresh")
    paths = ["/", "/?kind=lock_taken_over", "/locks", "/locks?state=released&sort=name&dir=desc", "/lock?name=billing",
             "/shared", "/tasks", "/tasks?code=email.send", "/history", "/history?lock=billing&job=send_reminders",
             "/task?code=email.send&key=order-1"]  # fmt: skip
    wide, violations = {}, {}
    for path in paths:
        page.goto(cluster.base + path)
        page.wait_for_timeout(int(REFRESH * 1500))  # one refresh in place
        width = page.evaluate("document.documentElement.scrollWidth")
        if width > 390:
            wide[path] = width
        found = _serious_violations(page, axe)
        if found:
            violations[path] = found
    assert not wide, f"wider than the 390 px viewport: {wide}"
    assert not violations, violations
    assert not errors, errors
    context.close()
