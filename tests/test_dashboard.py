"""The dashboard's app in process (mutexcron/dashboard/): reads that write nothing, the action
guard (token, CSRF, origin), bulk confirmation, masking, the ASGI adapter. The browser tests
against a real cluster are in test_dashboard_browser.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import os
import re
import secrets
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import event

from mutexcron.dashboard import create_app
from mutexcron.dashboard.app import Dashboard
from mutexcron.errors import ConfigurationError
from mutexcron.locks import lock_store_from_url
from mutexcron.locks.base import FireClaim, Node, Presence, RunInfo
from mutexcron.node import NodeTraits
from mutexcron.observability.feed import FeedEvent, feed_store_for
from mutexcron.tasks import Fail, task_store_from_url
from tests.backends import backend_params, cleanup_redis, drop_store_tables, require_server

TOKEN = "t0ken-for-the-dashboard-tests"
NODE = Node("node-a:1:aa", "10.0.0.1")
PAGES = ("/", "/locks", "/locks?state=active&sort=holder&dir=desc", "/lock?name=billing",
         "/tasks", "/tasks?state=any", "/history", "/history?lock=billing&job=close_invoices",
         "/task?code=email.send&key=order-1", "/api/status", "/api/sections/overview", "/api/sections/locks",
         "/api/sections/tasks", "/api/sections/history?lock=billing", "/api/trigger?job=close_invoices&lock=billing")  # fmt: skip


def call(app: Any, path: str, method: str = "GET", body: Any = None, headers: dict[str, str] | None = None,
         script_name: str = "") -> tuple[int, dict[str, str], str]:  # fmt: skip
    raw = json.dumps(body).encode() if body is not None else b""
    route, _, query = path.partition("?")
    environ: dict[str, Any] = {
        "REQUEST_METHOD": method, "SCRIPT_NAME": script_name, "PATH_INFO": route, "QUERY_STRING": query,
        "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "8465", "HTTP_HOST": "127.0.0.1:8465", "REMOTE_ADDR": "127.0.0.1",
        "CONTENT_LENGTH": str(len(raw)), "wsgi.input": io.BytesIO(raw), "wsgi.url_scheme": "http",
    }  # fmt: skip
    for name, value in (headers or {}).items():
        key = name.upper().replace("-", "_")
        environ[key if key == "CONTENT_TYPE" else f"HTTP_{key}"] = value
    started: dict[str, Any] = {}

    def start_response(status: str, response_headers: list[tuple[str, str]]) -> None:
        started.update(status=int(status.split()[0]), headers=dict(response_headers))

    data = b"".join(app(environ, start_response))
    return started["status"], started["headers"], data.decode()


def action_headers(app: Dashboard, token: str | None = TOKEN) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "X-CSRF-Token": app.guard.csrf_token()}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _url(kind: str, tmp_path: Path) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path}/dash.db"
    base = require_server("postgresql")
    suffix = f"d{os.getpid()}"
    return f"{base}?table=dash_{suffix}&tasks_table=dash_tasks_{suffix}"


def _drop(url: str) -> None:
    if not url.startswith("sqlite"):
        drop_store_tables(url)


@pytest.fixture(params=backend_params("sqlite", "postgresql"))
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    url = _url(request.param, tmp_path)
    _drop(url)
    yield url
    _drop(url)


def populate(url: str) -> None:
    """Two locks with runs, a node presence, tasks (one failed, two queued) and an event."""
    locks = lock_store_from_url(url)
    try:
        feed = feed_store_for(locks)
        assert feed is not None
        feed.append([FeedEvent("node_joined", NODE.node_id, None, f"node {NODE.node_id} joined")])
        for name, jobs in (("billing", ("close_invoices", "send_reminders")), ("reports", ("nightly_report",))):
            got = locks.acquire_or_renew(name, NODE, ttl=60, claim=FireClaim.new(jobs[0], 1_000_000))
            for i, job in enumerate(jobs * 3):
                run = RunInfo(0.05 * (i + 1), "ValueError: boom" if i == 1 else None, job,
                              datetime(2026, 1, 1, tzinfo=timezone.utc) + timedelta(seconds=i))  # fmt: skip
                assert locks.hand_off(name, NODE, got.token, run=run)
        assert locks.renew_many(NODE, {"billing": 1, "reports": 1}, presence=Presence("0.1.0", 0.002))
    finally:
        locks.close()
    tasks = task_store_from_url(lock_store_from_url(url).url)
    try:
        for key in ("order-1", "order-2", "order-3"):
            tasks.add("email.send", key, timedelta(0) if key == "order-1" else timedelta(hours=1))
        (claimed,) = tasks.claim("node-a", ["email.send"], 1, 30)
        assert tasks.complete("node-a", claimed.code, claimed.key, claimed.token, Fail("SMTP said no"))
    finally:
        tasks.close()


@pytest.fixture
def counted_statements() -> Iterator[list[str]]:
    """Every SQL statement any engine of this process sends, while the test runs."""
    sent: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        sent.append(" ".join(statement.split()))

    event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", record)
    yield sent
    event.remove(sqlalchemy.engine.Engine, "before_cursor_execute", record)


_WRITES = re.compile(r"^\s*(INSERT|UPDATE|DELETE|CREATE|ALTER|DROP|REPLACE|PRAGMA journal_mode)", re.IGNORECASE)


# -- reads write nothing ------------------------------------------------------------------------------
def test_every_page_of_an_unused_store_renders_and_creates_nothing(url: str, tmp_path: Path,
                                                                   counted_statements: list[str]) -> None:  # fmt: skip
    app = create_app(url)
    try:
        for path in PAGES:
            status, _headers, body = call(app, path)
            assert status == 200, (path, body)
        status, _, body = call(app, "/")
        assert "no node has used this store" in body
    finally:
        app.close()
    assert not (tmp_path / "dash.db").exists(), "the SQLite file was created by a read"
    assert not [s for s in counted_statements if _WRITES.match(s)]
    if not url.startswith("sqlite"):
        engine = sqlalchemy.create_engine(url.partition("?")[0])
        try:
            names = set(sqlalchemy.inspect(engine).get_table_names())
        finally:
            engine.dispose()
        assert not {n for n in names if n.startswith(f"dash_d{os.getpid()}") or n.startswith(f"dash_tasks_d{os.getpid()}")}


def test_every_page_of_a_used_store_renders_with_reads_only(url: str, counted_statements: list[str]) -> None:
    populate(url)
    counted_statements.clear()
    app = create_app(url, action_token=TOKEN)
    try:
        bodies = {path: call(app, path) for path in PAGES}
    finally:
        app.close()
    for path, (status, _headers, body) in bodies.items():
        assert status == 200, (path, body)
    assert not [s for s in counted_statements if _WRITES.match(s)], "a read wrote to the store"
    overview = bodies["/"][2]
    assert "node-a:1:aa" in overview and "+0.002s" in overview and "live" in overview
    assert "code email.send: 1 failed task" in overview
    locks, lock = bodies["/locks"][2], bodies["/lock?name=billing"][2]
    assert "billing" in locks and "close_invoices" in locks and 'data-action="pause"' in locks
    assert "send_reminders" in lock and "<svg" in lock and 'class="bar err"' in lock
    assert 'data-action="pause"' in lock and 'data-action="trigger"' in lock
    assert "order-1" in bodies["/tasks"][2] and "SMTP said no" in bodies["/tasks"][2]
    assert "order-2" not in bodies["/tasks"][2], "the Tasks page lists the failed tasks by default"
    assert "order-2" in bodies["/tasks?state=any"][2]
    assert "SMTP said no" in bodies["/task?code=email.send&key=order-1"][2]
    status = json.loads(bodies["/api/status"][2])
    assert [lock["name"] for lock in status["locks"]] == ["billing", "reports"] and status["calls"] == 5


def test_a_refresh_is_four_store_calls_shared_by_every_open_page(tmp_path: Path, counted_statements: list[str]) -> None:
    url = f"sqlite:///{tmp_path}/dash.db"
    populate(url)
    app = create_app(url, refresh=10)
    try:
        call(app, "/")  # the first read checks the tables once
        app.reader.invalidate()
        counted_statements.clear()
        for _ in range(5):  # five tabs within one refresh
            call(app, "/api/sections/overview")
    finally:
        app.close()
    assert len(counted_statements) == 4, counted_statements  # locks, nodes, tasks, the event feed (no run history)


# -- actions ------------------------------------------------------------------------------------------
def test_without_a_token_the_dashboard_is_read_only(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/dash.db"
    populate(url)
    app = create_app(url, action_token=None)
    try:
        _, _, page = call(app, "/locks")
        status, _, body = call(app, "/api/actions/pause", "POST", {"lock": "billing"}, action_headers(app))
    finally:
        app.close()
    assert "data-action" not in page and "read-only" in page
    assert status == 403 and "read-only" in json.loads(body)["error"]
    assert not _record(url, "billing").paused


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"Authorization": None}, "missing or wrong action token"),
        ({"Authorization": "Bearer wrong-token-of-enough-length"}, "missing or wrong action token"),
        ({"X-CSRF-Token": None}, "CSRF"),
        ({"X-CSRF-Token": "0" * 64}, "CSRF"),
        ({"Content-Type": "application/x-www-form-urlencoded"}, "application/json"),
        ({"Origin": "http://evil.example"}, "cross-origin"),
    ],
)
def test_an_action_without_token_csrf_json_or_same_origin_changes_nothing(tmp_path: Path, change: dict[str, str | None],
                                                                          why: str) -> None:  # fmt: skip
    url = f"sqlite:///{tmp_path}/dash.db"
    populate(url)
    app = create_app(url, action_token=TOKEN)
    headers = {k: v for k, v in {**action_headers(app), **change}.items() if v is not None}
    try:
        status, _, body = call(app, "/api/actions/pause", "POST", {"lock": "billing"}, headers)
    finally:
        app.close()
    assert status == 403 and why in json.loads(body)["error"]
    assert not _record(url, "billing").paused


def test_pause_resume_retry_with_the_token_are_recorded_with_who_did_them(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/dash.db"
    populate(url)
    app = create_app(url, action_token=TOKEN)
    headers = {**action_headers(app), "Origin": "http://127.0.0.1:8465"}
    try:
        status, _, body = call(app, "/api/actions/pause", "POST", {"lock": "billing", "by": "alice"}, headers)
        assert status == 200, body
        record = _record(url, "billing")
        assert record.paused and record.paused_by == "alice (dashboard, 127.0.0.1)"
        status, _, body = call(app, "/api/actions/resume", "POST", {"lock": "billing", "by": "bob", "catch_up": True}, headers)
        answer = json.loads(body)
        assert status == 200 and "catch-up requested: close_invoices" in answer["message"]
        assert list(answer["fire_times"]) == ["close_invoices"]  # the page follows each request
        assert not _record(url, "billing").paused and _record(url, "billing").paused_by == "bob (dashboard, 127.0.0.1)"
        status, _, body = call(app, "/api/actions/retry", "POST", {"code": "email.send", "key": "order-1"}, headers)
        assert status == 200, body
        status, _, body = call(app, "/api/actions/retry", "POST", {"code": "email.send", "key": "order-2"}, headers)
        assert status == 409 and "it is queued, not failed" in json.loads(body)["error"]
        status, _, body = call(app, "/api/actions/pause", "POST", {"lock": "no-such-lock"}, headers)
        assert status == 404 and _record(url, "no-such-lock") is None, "a bad name changes nothing"
        _, _, overview = call(app, "/")
    finally:
        app.close()
    assert "alice (dashboard, 127.0.0.1)" in overview and "resume --catch-up" in overview
    events = overview.split('id="s-events"')[1]  # in the feed at once, by whom (a node sees it at its next read)
    assert "lock billing paused by alice (dashboard, 127.0.0.1)" in events
    assert "lock billing resumed with catch-up by bob (dashboard, 127.0.0.1)" in events


def test_a_bulk_action_runs_only_on_the_count_the_operator_confirmed(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/dash.db"
    populate(url)
    app = create_app(url, action_token=TOKEN)
    selection = {"code": "email.send", "state": "queued"}
    try:
        _, _, page = call(app, "/tasks?code=email.send&state=queued")
        assert "2 tasks match" in page and "Cancel 2" in page
        status, _, body = call(app, "/api/actions/bulk", "POST", {"action": "cancel", "selection": selection, "expected": 3},
                               action_headers(app))  # fmt: skip
        assert status == 409 and "the selection changed: 2 tasks match now" in json.loads(body)["error"]
        assert len(_tasks(url)) == 3, "nothing was cancelled"
        status, _, body = call(app, "/api/actions/bulk", "POST", {"action": "cancel", "selection": selection, "expected": 2},
                               action_headers(app))  # fmt: skip
        assert status == 200 and json.loads(body)["done"] == 2
    finally:
        app.close()
    assert [t.key for t in _tasks(url)] == ["order-1"]


def test_a_short_token_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="at least 16"):
        create_app("memory://", action_token="short")


# -- secrets ------------------------------------------------------------------------------------------
@pytest.mark.postgresql
def test_no_page_shows_the_password_of_the_store_url(tmp_path: Path) -> None:
    base = require_server("postgresql")
    secret = "pw-S3cret-dash"
    url = _url("postgresql", tmp_path).replace("postgres@", f"postgres:{secret}@", 1)
    assert secret in url
    _drop(url)
    try:
        populate(url)
        app = create_app(url, action_token=TOKEN)
        try:
            bodies = [call(app, path)[2] for path in PAGES]
            bodies.append(call(app, "/api/actions/pause", "POST", {"lock": "nope"}, action_headers(app))[2])
        finally:
            app.close()
        assert all(secret not in body for body in bodies)
        assert "postgres:***@" in bodies[0]
    finally:
        _drop(url)
    assert base


def test_a_trigger_whose_fire_time_a_scheduled_run_claimed_past_shows_that_run(tmp_path: Path) -> None:
    """A request the holder saw after the job's next scheduled slot was claimed completes with that
    run's outcome (mutexcron/guard/triggers.py): the page shows it, not 'no run history is kept'."""
    url = f"sqlite:///{tmp_path}/dash.db"
    populate(url)  # close_invoices ran at fire times 00:00:00, :02 and :04
    app = create_app(url, action_token=TOKEN)
    try:
        asked = "2026-01-01T00:00:01.500000+00:00"
        _, _, body = call(app, f"/api/trigger?job=close_invoices&lock=billing&fire_time={asked.replace('+', '%2B')}")
    finally:
        app.close()
    assert json.loads(body) == {"state": "success", "node": NODE.node_id, "duration": pytest.approx(0.15), "error": None,
                                "fire_time": "2026-01-01T00:00:02+00:00", "merged": True}  # issue 32, C1: said so


def test_run_now_withdraws_an_earlier_failed_request_so_the_new_one_runs(tmp_path: Path) -> None:
    """A failed request (its holder lacked the job) must not answer the next "run now": with
    ``on_conflict="keep"`` the new request would join it, and the page would show the old failure."""
    from mutexcron.guard.triggers import trigger_code

    url = f"sqlite:///{tmp_path}/dash.db"
    populate(url)
    code, tasks = trigger_code("close_invoices"), task_store_from_url(url)
    app = create_app(url, action_token=TOKEN)
    try:
        tasks.add(code, "close_invoices", timedelta(0), {"requested_by": "an earlier click"})
        token = tasks.claim("another-node", [code], 1, 30.0)[0].token
        tasks.start("another-node", [(code, "close_invoices", token)])
        assert tasks.complete("another-node", code, "close_invoices", token, Fail("job not on its holder"))
        status, _, body = call(app, "/api/actions/trigger", "POST", {"job": "close_invoices", "by": "carol"},
                               action_headers(app))  # fmt: skip
        request = tasks.get(code, "close_invoices")
    finally:
        app.close()
        tasks.close()
    assert status == 200 and json.loads(body)["message"] == "close_invoices: requested", body
    assert request is not None and request.state == "queued", request
    assert request.payload["requested_by"].startswith("carol "), request.payload


def test_a_store_url_with_a_query_leaves_the_page_markup_whole(tmp_path: Path) -> None:
    """The store URL in the header is followed by the token form: the body's redaction re-encoded
    the URL's query and swallowed the form (`#token button` never appeared in the browser)."""
    url = f"sqlite:///{tmp_path}/dash.db?table=dash_locks&tasks_table=dash_tasks"
    populate(url)
    app = create_app(url, action_token=TOKEN)
    try:
        pages = [call(app, path)[2] for path in ("/", "/locks", "/tasks")]
    finally:
        app.close()
    for page in pages:
        assert "table=dash_locks&amp;tasks_table=dash_tasks</span>" in page
        assert '<form id="token" class="token"' in page and "%3C" not in page


# -- mounting -----------------------------------------------------------------------------------------
def test_mounted_under_a_prefix_in_wsgi_and_asgi_every_link_stays_under_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/dash.db"
    populate(url)
    app = create_app(url, action_token=TOKEN)
    try:
        _, _, wsgi_page = call(app, "/locks", script_name="/ops/cron")
        status, headers, asgi_page = asyncio.run(_asgi_get(app.asgi, "/ops/cron/locks", "/ops/cron"))
        _, _, css = call(app, "/static/dashboard.css")
    finally:
        app.close()
    for page in (wsgi_page, asgi_page):
        assert 'href="/ops/cron/static/dashboard.css"' in page and 'href="/ops/cron/history?lock=billing' in page
        assert 'content="/ops/cron"' in page
    assert status == 200 and headers[b"content-security-policy"].startswith(b"default-src 'none'")
    assert "svg .bar.ok" in css


async def _asgi_get(asgi: Any, path: str, root_path: str) -> tuple[int, dict[bytes, bytes], str]:
    scope = {"type": "http", "method": "GET", "path": path, "root_path": root_path, "query_string": b"", "headers": [],
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000)}  # fmt: skip
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await asgi(scope, receive, send)
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"].decode()


def _record(url: str, name: str) -> Any:
    store = lock_store_from_url(url)
    try:
        return store.read(name)
    finally:
        store.close()


def _tasks(url: str) -> list[Any]:
    store = task_store_from_url(url)
    try:
        return store.list()
    finally:
        store.close()


# -- shared jobs --------------------------------------------------------------------------------------
def test_the_shared_jobs_page_shows_schedule_next_run_holder_and_acts_like_mutexcron_jobs(
    tmp_path: Path, counted_statements: list[str]
) -> None:
    """Schedule, next run and holder of each shared job; pause, resume, remove (the same writes as
    ``mutexcron jobs``) and run now (a trigger), each with the token only; its reads write nothing."""
    import textwrap

    from mutexcron import MutexScheduler
    from tests import shared_jobs
    from tests.shared_jobs import open_jobstore, runs_of

    lock_url = f"sqlite:///{tmp_path}/locks.db"
    with open_jobstore("sqlite", tmp_path) as ctx:
        jobs_file = tmp_path / "jobs.py"
        jobs_file.write_text(textwrap.dedent(f"""
            from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
            from mutexcron import MutexScheduler
            sched = MutexScheduler(jobstores={{"default": SQLAlchemyJobStore(**{ctx.spec["options"]!r})}}, lock_url={lock_url!r})
        """))
        shared_jobs.clear_runs()
        web = MutexScheduler(jobstores={"default": ctx.make()}, lock_url=lock_url, triggers=False)
        web.start(paused=True)
        worker = MutexScheduler(jobstores={"default": ctx.make()}, lock_url=lock_url, unactive_interval=2)
        app = create_app(lock_url, jobs=str(jobs_file), action_token=TOKEN)
        try:
            web.add_job(shared_jobs.tick, "interval", seconds=2, id="report", kwargs={"job": "report"})
            web.add_job(shared_jobs.tick, "cron", hour=3, id="daily", kwargs={"job": "daily"})
            counted_statements.clear()
            status, _, page = call(app, "/shared")
            assert status == 200, page
            assert call(app, "/api/sections/shared")[0] == 200
            assert not [s for s in counted_statements if _WRITES.match(s)], "a read wrote to a store"
            assert ">Shared jobs</a>" in page and "interval[0:00:02]" in page and "cron[hour=&#x27;3&#x27;]" in page
            for action in ('data-action="job_pause"', 'data-action="trigger"', 'data-action="job_remove"'):
                assert action in page

            worker.start()
            deadline = datetime.now(timezone.utc) + timedelta(seconds=15)
            while worker.node_id not in call(app, "/api/sections/shared")[2]:  # the holder column
                assert datetime.now(timezone.utc) < deadline, "the worker's holding never showed"
                time.sleep(0.05)
                app.reader.invalidate()
            store = web._jobstores["default"]

            def next_run(job: str) -> Any:
                return web.get_job(job).next_run_time

            status, _, body = call(app, "/api/actions/job_pause", "POST", {"job": "report"}, action_headers(app, None))
            assert status == 403 and next_run("report") is not None, body
            status, _, body = call(app, "/api/actions/job_pause", "POST", {"job": "report", "by": "carol"}, action_headers(app))
            assert status == 200 and "report: paused" in json.loads(body)["message"], body
            assert next_run("report") is None
            assert 'data-action="job_resume"' in call(app, "/shared")[2]
            status, _, body = call(app, "/api/actions/job_resume", "POST", {"job": "report"}, action_headers(app))
            assert status == 200 and next_run("report") is not None, body
            status, _, body = call(app, "/api/actions/trigger", "POST", {"job": "daily", "by": "carol"}, action_headers(app))
            assert status == 200, body
            deadline = datetime.now(timezone.utc) + timedelta(seconds=20)
            while not runs_of("daily"):
                assert datetime.now(timezone.utc) < deadline, "the run-now request did not run"
                time.sleep(0.05)
            before = store._read_states()["report"]
            for bad in ("", "every -5", "61 * * * *", "hourly"):  # refused with both forms named; nothing written
                status, _, body = call(app, "/api/actions/job_reschedule", "POST", {"job": "report", "schedule": bad},
                                       action_headers(app))  # fmt: skip
                assert status == 400 and "give a crontab line ('0 6 * * mon') or 'every N' seconds" in body, body
            assert store._read_states()["report"] == before
            status, _, body = call(app, "/api/actions/job_reschedule", "POST", {"job": "report", "schedule": "0 6 * * mon"},
                                   action_headers(app))  # fmt: skip
            assert status == 200 and "report: rescheduled to cron[" in json.loads(body)["message"], body
            assert str(web.get_job("report").trigger).startswith("cron[") and next_run("report").hour == 6
            status, _, body = call(app, "/api/actions/job_reschedule", "POST", {"job": "report", "schedule": "every 300"},
                                   action_headers(app))  # fmt: skip
            assert status == 200 and next_run("report").timestamp() % 300 == 0, body  # anchored as every node anchors
            assert 'data-action="job_reschedule"' in call(app, "/shared")[2]
            status, _, body = call(app, "/api/actions/job_remove", "POST", {"job": "report"}, action_headers(app))
            assert status == 200 and "report" not in store._read_states(), body
            status, _, body = call(app, "/api/actions/job_remove", "POST", {"job": "report"}, action_headers(app))
            assert status == 404 and "no job 'report'" in json.loads(body)["error"]
            _, _, overview = call(app, "/")
            assert "job pause" in overview and "carol (dashboard, 127.0.0.1)" in overview
        finally:
            app.close()
            worker.shutdown(wait=False)
            web.shutdown(wait=False)


def test_a_store_url_with_several_options_keeps_the_page_markup(tmp_path: Path) -> None:
    """The page's own pass over the body for secrets (redact): the masked store URL in the header
    (``...?table=a&amp;tasks_table=b``) neither swallows the token form after it nor is re-encoded,
    on the page and in its refreshed sections."""
    url = f"sqlite:///{tmp_path}/dash.db?table=dash_locks&tasks_table=dash_tasks"
    populate(url)
    app = create_app(url, action_token=TOKEN)
    try:
        _, _, page = call(app, "/locks")
        _, _, sections = call(app, "/api/sections/overview")
    finally:
        app.close()
    assert '<form id="token"' in page and "dash_locks&amp;tasks_table=dash_tasks</span>" in page
    assert "%3B" not in page and "%3C" not in page
    counts = json.loads(sections)["sections"]["counts"]  # refreshed in place: the same HTML, through JSON
    assert "dash_locks&amp;tasks_table=dash_tasks" in counts and "%3B" not in counts


@pytest.mark.mongodb
def test_a_read_only_mongodb_task_store_creates_no_index_on_a_read() -> None:
    """The dashboard's reads: a read-only backend reads the task collection without creating it or
    its indexes (a write, and one the dashboard's user may have no privilege for)."""
    from tests.mongomock_support import open_mongomock_tasks

    make, _clock = open_mongomock_tasks(f"ro{secrets.token_hex(3)}")
    store = make()
    store.backend.read_only = True
    assert store.list(limit=10) == [] and store.get("mail", "k") is None
    store.summary()
    assert store.collection.name not in store.collection.database.list_collection_names()


@pytest.mark.redis
def test_a_read_only_redis_task_store_fills_no_index_on_a_read() -> None:
    """Tasks written before the per-code due index existed are indexed by a node, not by a reader."""
    from mutexcron.tasks.stores.redis import RedisTaskStore

    url = f"{require_server('redis')}?namespace=ro-{secrets.token_hex(3)}"
    store = RedisTaskStore(url)
    try:
        store.add("mail", "k1", timedelta(hours=1))
        dues = store.backend.key("dues:mail")
        store.backend.client.delete(dues)  # as an earlier mutexcron left it
        store.backend.read_only = True
        store.list(code="mail")
        assert not store.backend.client.exists(dues), "a read-only list wrote the index"
        store.backend.read_only = False
        assert [t.key for t in store.list(code="mail")] == ["k1"]  # a node's list fills it
    finally:
        cleanup_redis(url)
        store.close()


def test_the_asgi_app_refuses_an_oversized_body_before_buffering_it(tmp_path: Path) -> None:
    """An unauthenticated POST cannot make the ASGI adapter buffer more than the app's limit."""
    from mutexcron.dashboard.app import MAX_BODY

    app = create_app(f"sqlite:///{tmp_path}/none.db").asgi
    chunk = b"x" * (MAX_BODY // 4)
    received = 0

    async def receive() -> dict[str, Any]:
        nonlocal received
        received += 1
        return {"type": "http.request", "body": chunk, "more_body": True}  # never ends

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/api/actions/pause", "query_string": b"", "headers": [],
             "root_path": "", "scheme": "http", "server": ("127.0.0.1", 8465), "client": ("127.0.0.1", 1)}  # fmt: skip
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 413 and received <= 5


# -- layering -----------------------------------------------------------------------------------------
def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports (relative imports resolved against its package), at any depth."""
    import ast

    package = ["mutexcron", *path.parent.relative_to(Path(__file__).parent.parent / "mutexcron").parts]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names}
    return found


def test_the_dashboard_imports_nothing_from_the_command_line_package() -> None:
    """cli/ registers the dashboard's command; the dashboard uses what lies below both (formatting,
    console, jobsfile, jobstores.admin), never cli/: no two-way dependency between the folders."""
    root = Path(__file__).parent.parent / "mutexcron" / "dashboard"
    modules = sorted(root.rglob("*.py"))
    assert len(modules) >= 10
    offending = {
        str(path.relative_to(root)): sorted(m for m in _imported_modules(path) if f"{m}.".startswith("mutexcron.cli."))
        for path in modules
    }
    assert not {k: v for k, v in offending.items() if v}
    assert "mutexcron.formatting" in _imported_modules(root / "views.py")  # the scan resolves relative imports


# -- the server: a cap on connections and a deadline per request -----------------------------------
def _hello(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "5")])
    return [b"hello"]


@pytest.fixture
def served() -> Iterator[Any]:
    """A dashboard server with a cap of 3 connections and a 2 s deadline, serving in a thread."""
    import threading

    from mutexcron.dashboard.server import make

    server = make(_hello, "127.0.0.1", 0, max_connections=3, deadline=2.0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


def _get(port: int, timeout: float = 5.0) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"GET /tasks HTTP/1.0\r\nHost: x\r\n\r\n")
        return _read_all(sock)


def _read_all(sock: Any) -> bytes:
    """Everything the server sends until it closes (a reset counts as closed)."""
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _stalled(port: int, sent: bytes = b"GET /tasks?key=secret HTTP/1.1\r\nHost: x\r\n") -> Any:
    """A client that sends part of a request and then nothing (the server's thread waits for the rest)."""
    import socket

    sock = socket.create_connection(("127.0.0.1", port), timeout=10.0)
    sock.sendall(sent)
    return sock


def test_a_client_that_sends_half_a_request_is_closed_at_the_deadline_with_one_log_line(
    served: Any, caplog: pytest.LogCaptureFixture
) -> None:
    port = served.server_address[1]
    caplog.set_level("WARNING", logger="mutexcron.dashboard.server")
    client = _stalled(port)
    try:
        started = time.monotonic()
        assert _read_all(client) == b"", "nothing is served for an incomplete request"
        assert time.monotonic() - started < 6.0, "closed at its 2 s deadline, not left to hang"
    finally:
        client.close()
    deadline = time.monotonic() + 5
    while not any("not complete" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
        time.sleep(0.02)
    (line,) = [r.getMessage() for r in caplog.records if "not complete" in r.getMessage()]
    assert "127.0.0.1" in line and "GET /tasks" in line and "secret" not in line, line
    assert b"hello" in _get(port), "the server serves on"


def test_a_trickling_client_is_closed_at_the_deadline(served: Any) -> None:
    """A byte every 0.2 s: no read ever waits long, the whole request never completes."""
    port = served.server_address[1]
    client = _stalled(port, b"G")
    try:
        started = time.monotonic()
        closed = False
        while time.monotonic() - started < 8.0 and not closed:
            try:
                client.sendall(b"E")
                time.sleep(0.2)
            except OSError:
                closed = True
            else:
                client.settimeout(0.01)
                with contextlib.suppress(TimeoutError):
                    closed = client.recv(1) == b""
        assert closed and time.monotonic() - started < 6.0
    finally:
        client.close()


def test_clients_over_the_cap_are_answered_503_at_once_and_never_starve_the_others(served: Any) -> None:
    port = served.server_address[1]
    held = [_stalled(port) for _ in range(2)]
    try:
        assert b"hello" in _get(port, timeout=2.0), "one slot left: a normal client is served at once"
        held.append(_stalled(port))
        time.sleep(0.2)  # the three stalled ones hold every slot
        started = time.monotonic()
        busy = _get(port, timeout=2.0)
        assert busy.startswith(b"HTTP/1.0 503") and b"Retry-After: 1" in busy, busy
        assert time.monotonic() - started < 1.0, "refused at once, not queued behind the stalled ones"
        assert served.refused >= 1
        deadline = time.monotonic() + 8.0
        while time.monotonic() < deadline:  # the stalled ones are cut at their deadline: served again
            if b"hello" in _get(port, timeout=2.0):
                break
            time.sleep(0.1)
        else:
            pytest.fail("the server never served again after the stalled clients' deadline")
        assert time.monotonic() - started < 6.0
    finally:
        for client in held:
            client.close()


# -- alarms: nodes that disagree --------------------------------------------------------------------
def _write_jobs_file(path: Path, url: str, zone: str = "UTC", lease: int = 30) -> str:
    path.write_text(
        "from mutexcron import MutexScheduler\n"
        f"sched = MutexScheduler(lock_url={url!r}, timezone={zone!r}, unactive_interval={lease})\n"
        "sched.add_job(print, 'cron', hour=2, id='close_invoices', mutex='billing')\n"
        "sched.add_job(print, 'interval', minutes=5, id='send_reminders', mutex='billing')\n",
        encoding="utf-8",
    )
    return str(path)


def test_the_alarm_names_the_lock_and_its_holder_when_its_record_says_another_jobs_file(tmp_path: Path) -> None:
    """Zone, lease and triggers as the holder wrote them in the lock record, against the jobs file,
    by the nodes' own rule (guard.agreement): one alarm per lock, an error when the zone differs."""
    from mutexcron.dashboard.alarms import alarms
    from mutexcron.dashboard.jobsfile import load_jobs_file
    from mutexcron.dashboard.reads import Snapshot
    from mutexcron.locks.record import LockRecord

    spec = _write_jobs_file(tmp_path / "jobs.py", f"sqlite:///{tmp_path}/dash.db")
    jobs = load_jobs_file(spec)
    # What a node running this file writes as holder (MutexScheduler's own _lock_zone/_lock_triggers).
    assert jobs.zone_of("billing") == jobs.scheduler._lock_zone("billing") == "UTC"
    assert jobs.triggers_of("billing") == jobs.scheduler._lock_triggers("billing")
    assert jobs.lease_of("billing") == 30
    same = LockRecord("billing", holder="node-b:2:bb", heartbeat_age=1.0, ttl=30.0, zone="UTC",
                      triggers=jobs.triggers_of("billing"))  # fmt: skip
    trigger = jobs.triggers_of("billing")["close_invoices"]

    def nodes_alarms(record: LockRecord) -> list[Any]:
        snap = Snapshot("sqlite:///x", datetime.now(timezone.utc), True, [record], [], {}, [])
        return [a for a in alarms(snap, jobs) if "jobs file" in a.text]

    assert nodes_alarms(same) == []
    (lease,) = nodes_alarms(dataclasses.replace(same, ttl=60.0))
    assert lease.level == "warning" and lease.kind == "nodes"
    assert lease.text.startswith(f"lock billing: its holder node-b:2:bb runs another jobs file than {spec}: ")
    assert f"lease 60s on node-b:2:bb, 30s in {spec}" in lease.text
    (zone,) = nodes_alarms(dataclasses.replace(same, zone="Europe/Paris"))
    assert zone.level == "error" and f"time zone Europe/Paris on node-b:2:bb, UTC in {spec}" in zone.text
    assert "runs none of the lock's jobs" in zone.text
    other = {"close_invoices": trigger.replace("hour='2'", "hour='4'"), "purge": "interval[0:01:00]"}
    (triggers,) = nodes_alarms(dataclasses.replace(same, triggers=other))
    assert "job 'close_invoices': " in triggers.text and "hour='4'" in triggers.text and f"in {spec}" in triggers.text
    assert "job 'purge' only on node-b:2:bb" in triggers.text and f"job 'send_reminders' only in {spec}" in triggers.text
    (everything,) = nodes_alarms(dataclasses.replace(same, ttl=60.0, zone="Europe/Paris", triggers=other))
    assert everything.level == "error" and "time zone" in everything.text and "lease" in everything.text
    assert nodes_alarms(dataclasses.replace(same, zone=None, triggers=None)) == [], "a record from before zones: no alarm"
    assert nodes_alarms(dataclasses.replace(same, ttl=60.0, heartbeat_age=90.0)) == [], "stale: its own alarm"
    assert nodes_alarms(dataclasses.replace(same, name="unknown", ttl=60.0)) == [], "a lock the file does not name"


@pytest.mark.sqlite
def test_a_holder_running_another_jobs_file_shows_on_the_overview(tmp_path: Path) -> None:
    """End to end: a real node in another zone, with another lease and trigger, takes the lock and
    writes its record; the Overview of a dashboard given the jobs file names the lock and the node."""
    from mutexcron import MutexScheduler

    url = f"sqlite:///{tmp_path}/dash.db"
    spec = _write_jobs_file(tmp_path / "jobs.py", url)
    node = MutexScheduler(lock_url=url, node_id="paris-node", timezone="Europe/Paris", unactive_interval=3)
    node.add_job(print, "cron", hour=3, id="close_invoices", mutex="billing")
    node.start()
    app = create_app(url, jobs=spec)
    try:
        deadline = time.monotonic() + 20
        while (record := node.lock_store.read("billing")) is None or record.zone != "Europe/Paris":
            assert time.monotonic() < deadline, "the node never wrote its zone"
            time.sleep(0.05)
        app.reader.invalidate()
        _, _, body = call(app, "/api/sections/overview")
        shown = json.loads(body)["sections"]["alarms"]
        assert f"lock billing: its holder paris-node runs another jobs file than {spec}" in shown, shown
        assert "time zone Europe/Paris on paris-node, UTC in" in shown and "lease 3s on paris-node, 30s in" in shown
        assert "job &#x27;send_reminders&#x27; only in" in shown and "alarm error" in shown
    finally:
        app.close()
        node.shutdown(wait=False)


# -- the Tasks page: throughput ----------------------------------------------------------------------
def test_the_tasks_page_charts_tasks_finished_and_cancelled_per_minute_apart(url: str, counted_statements: list[str]) -> None:
    """Ended tasks leave their tombstone's time and how they ended: three finished, two cancelled (a
    queued one, and a running one whose attempt then ended) and a code whose every task finished
    are charted, finished and cancelled as two series; a failed task has not ended; the read writes
    nothing and serves pages for 30 s."""
    from mutexcron.tasks import Done

    tasks = task_store_from_url(lock_store_from_url(url).url)
    try:
        for key in ("k0", "k1", "k2", "k3", "k4"):
            tasks.add("email.send", key, timedelta(0))
        tasks.add("email.send", "later", timedelta(hours=1))
        tasks.add("report.build", "daily", timedelta(0))
        claimed = tasks.claim("node-a", ["email.send", "report.build"], 10, 30)
        assert len(claimed) == 6
        assert tasks.cancel("email.send", "later") and tasks.cancel("email.send", "k4")
        for task in claimed:
            outcome = Fail("no") if task.key == "k3" else Done()
            assert tasks.complete("node-a", task.code, task.key, task.token, outcome)
    finally:
        tasks.close()
    app = create_app(url)
    try:
        counted_statements.clear()
        status, _, page = call(app, "/tasks")
        assert status == 200, page
        flow = app.reader.throughput(app.reader.snapshot().now)
        assert flow is not None and flow.note is None and flow.complete_from is None and not flow.every_end
        assert {code: sum(counts) for code, counts in flow.per_minute.items()} == {"email.send": 3, "report.build": 1}
        assert {code: sum(counts) for code, counts in flow.cancelled.items()} == {"email.send": 2, "report.build": 0}
        assert all(len(counts) == 60 for counts in (*flow.per_minute.values(), *flow.cancelled.values()))
        assert "email.send: finished and cancelled per minute" in page
        assert "last 60 min: 3 finished, 2 cancelled" in page, "a cancel is counted as a cancel, not a finish"
        assert "finished/min" in page and "cancelled/min" in page, "two series, one legend"
        assert "report.build: finished and cancelled per minute" in page, "a code with no task left"
        assert "last 60 min: 1 finished, 0 cancelled" in page
        for _ in range(3):
            assert "last 60 min: 3 finished, 2 cancelled" in json.loads(call(app, "/api/sections/tasks")[2])["sections"]["codes"]
    finally:
        app.close()
    assert not [s for s in counted_statements if _WRITES.match(s)], "a read wrote to the store"
    assert len([s for s in counted_statements if "state = 'done' AND updated >=" in s]) == 1, "one read for 30 s"


@pytest.mark.redis
def test_a_redis_task_store_counts_finished_and_cancelled_per_minute_for_the_chart() -> None:
    """Redis keeps no tombstone: the scripts that end an occurrence count it per minute (finished or
    cancelled), and the Tasks page charts those counts; the read creates no key."""
    from mutexcron.tasks import Done

    url = f"{require_server('redis')}?namespace=dash-{secrets.token_hex(3)}"
    tasks = task_store_from_url(url)
    try:
        for key in ("k0", "k1", "k2"):
            tasks.add("email.send", key, timedelta(0))
        tasks.add("email.send", "later", timedelta(hours=1))
        for task in tasks.claim("node-a", ["email.send"], 10, 30):
            assert tasks.complete("node-a", task.code, task.key, task.token, Done())
        assert tasks.cancel("email.send", "later")
        client = tasks.backend.client  # type: ignore[attr-defined]
        keys_before = sorted(client.scan_iter(match=f"{tasks.backend.prefix}*"))  # type: ignore[attr-defined]
        app = create_app(url)
        try:
            page = call(app, "/tasks")[2]
            flow = app.reader.throughput(app.reader.snapshot().now)
        finally:
            app.close()
        assert flow is not None and flow.note is None and flow.every_end
        assert sum(flow.per_minute["email.send"]) == 3 and sum(flow.cancelled["email.send"]) == 1
        assert "email.send: finished and cancelled per minute" in page and "last 60 min: 3 finished, 1 cancelled" in page
        assert "every end, as the store counts them" in page and "no throughput chart" not in page
        assert sorted(client.scan_iter(match=f"{tasks.backend.prefix}*")) == keys_before, "a read wrote a key"  # type: ignore[attr-defined]
        [counter] = [k for k in keys_before if ":finished:" in str(k)]
        assert 0 < client.ttl(counter) <= 7200, "the per-minute counts expire"
    finally:
        tasks.close()
        cleanup_redis(url)


@pytest.mark.redis
def test_a_redis_end_count_that_cannot_be_written_never_fails_the_completion() -> None:
    """The count is the script's last write, and a failed one (a foreign value at the minute's key)
    is skipped: the task still ends (a script is not rolled back: a raise would leave it half done)."""
    from mutexcron.tasks import Done

    url = f"{require_server('redis')}?namespace=dash-{secrets.token_hex(3)}"
    tasks: Any = task_store_from_url(url)
    try:
        tasks.add("email.send", "k", timedelta(0))
        [task] = tasks.claim("node-a", ["email.send"], 10, 30)
        minute = int(tasks.now().timestamp() // 60)
        for key in (minute, minute + 1):  # the next minute too: the completion may fall in it
            tasks.backend.client.set(f"{tasks.backend.prefix}finished:{key}", "not a hash")
        assert tasks.complete("node-a", "email.send", "k", task.token, Done())
        assert tasks.get("email.send", "k") is None
    finally:
        tasks.close()
        cleanup_redis(url)


@pytest.mark.mongodb
def test_the_ends_of_a_mongodb_task_store_are_read_without_a_write() -> None:
    from mutexcron.dashboard.finished import finished_since
    from mutexcron.tasks import Done
    from tests.mongomock_support import CLOCK_ORIGIN, open_mongomock_tasks

    make, clock = open_mongomock_tasks(f"fin{secrets.token_hex(3)}")
    store = make()
    store.add("mail", "k1", timedelta(0))
    store.add("mail", "k2", timedelta(0))
    store.add("mail", "k3", timedelta(hours=1))
    for task in store.claim("node-a", ["mail"], 2, 30):
        clock.advance(61)
        assert store.complete("node-a", task.code, task.key, task.token, Done())
    clock.advance(61)
    assert store.cancel("mail", "k3")
    reader = make()
    reader.backend.read_only = True
    found = finished_since(reader, CLOCK_ORIGIN, 10)
    ways = [(end.code, end.cancelled, end.occurrences) for end in found]
    assert ways == [("mail", True, 1), ("mail", False, 1), ("mail", False, 1)], "the cancel is the newest"
    assert found[0].at > found[1].at > found[2].at >= CLOCK_ORIGIN, "newest first, by the store's clock"
    assert finished_since(reader, found[0].at, 10) == found[:1]
    assert finished_since(reader, CLOCK_ORIGIN, 1) == found[:1], "at most the limit"


def test_no_missed_run_alarm_inside_the_grace_the_nodes_use_during_a_takeover(tmp_path: Path) -> None:
    """A node gives a guarded job a grace of 2 x the lease (20 s for a 10 s lease) when it starts;
    the dashboard never starts the jobs file's scheduler, and must judge by the same grace, not by
    APScheduler's 1 s default: a fire time 3 s old, during a takeover, is not missed."""
    from mutexcron.dashboard.alarms import alarms
    from mutexcron.dashboard.jobsfile import load_jobs_file
    from mutexcron.dashboard.reads import Snapshot
    from mutexcron.locks.record import LockRecord

    spec = tmp_path / "jobs.py"
    spec.write_text(
        "from mutexcron import MutexScheduler\n"
        f"sched = MutexScheduler(lock_url='sqlite:///{tmp_path}/dash.db', unactive_interval=10)\n"
        "sched.add_job(print, 'interval', seconds=2, id='sync_catalog', mutex='catalog')\n"
        "sched.add_job(print, 'interval', seconds=2, id='own_grace', mutex='catalog', misfire_grace_time=5)\n",
        encoding="utf-8",
    )
    jobs = load_jobs_file(str(spec))
    assert jobs.jobs["sync_catalog"].misfire_grace_time == 20 and jobs.jobs["own_grace"].misfire_grace_time == 5
    now = datetime(2026, 11, 28, 12, 0, 0, tzinfo=timezone.utc)

    def missed(last_claimed: float) -> list[str]:
        fired = now - timedelta(seconds=last_claimed)
        record = LockRecord("catalog", holder=None, heartbeat_age=last_claimed, ttl=10.0,
                            fire_times={"sync_catalog": fired, "own_grace": fired})  # fmt: skip
        snap = Snapshot("sqlite:///x", now, True, [record], [], {}, [])
        return [a.text.split(":")[0] for a in alarms(snap, jobs) if a.kind == "missed-run"]

    assert missed(3.0) == [], "a takeover inside the grace: no alarm"
    assert missed(9.0) == ["job own_grace"], "past the user's own 5 s grace"
    assert missed(25.0) == ["job sync_catalog", "job own_grace"]


def pages(url: str, *paths: str) -> list[str]:
    """The bodies of ``paths`` from a read-only dashboard of ``url``."""
    app = create_app(url)
    try:
        return [call(app, path)[2] for path in paths]
    finally:
        app.close()


def test_the_token_is_checked_as_it_is_entered_and_the_check_changes_nothing(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/dash.db"
    populate(url)
    app = create_app(url, action_token=TOKEN)
    try:
        good = call(app, "/api/actions/token", "POST", {"by": "alice"}, action_headers(app))
        wrong = call(app, "/api/actions/token", "POST", {"by": "alice"}, action_headers(app, "wrong-token-of-enough-length"))
    finally:
        app.close()
    assert good[0] == 200 and json.loads(good[2])["message"] == "token accepted: actions as alice (dashboard, 127.0.0.1)"
    assert wrong[0] == 403 and json.loads(wrong[2])["error"] == "missing or wrong action token"
    assert not _record(url, "billing").paused and app.audit.entries() == []


def test_alarms_link_to_their_lock_job_task_code_or_node_and_internal_codes_are_hidden(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/dash.db"
    populate(url)
    tasks = task_store_from_url(lock_store_from_url(url).url)
    try:
        tasks.add("mutexcron.trigger", "req-1", timedelta(hours=1))
    finally:
        tasks.close()
    overview, tasks_page, with_internal, lock_page = pages(url, "/", "/tasks", "/tasks?internal=1", "/lock?name=billing")
    assert '<a href="/tasks?code=email.send&amp;state=failed">code email.send: 1 failed task</a>' in overview
    assert "mutexcron.trigger</a>" not in tasks_page and "show mutexcron's own codes (1)" in tasks_page
    assert "mutexcron.trigger</a>" in with_internal
    assert "<h1>Lock billing</h1>" in lock_page and "close_invoices" in lock_page


def test_the_trigger_requests_codes_are_one_row(tmp_path: Path) -> None:
    """One code per bucket of job ids (mutexcron/guard/triggers.py): up to 257 codes, one row."""
    from mutexcron.guard.triggers import trigger_code

    url = f"sqlite:///{tmp_path}/dash.db"
    populate(url)
    tasks = task_store_from_url(lock_store_from_url(url).url)
    try:
        jobs = ["nightly_report", "billing_sync"]
        assert trigger_code(jobs[0]) != trigger_code(jobs[1])
        tasks.add("mutexcron.trigger", "old-cli", timedelta(hours=1))
        for job in jobs:
            tasks.add(trigger_code(job), job, timedelta(hours=1))
    finally:
        tasks.close()
    tasks_page, with_internal = pages(url, "/tasks", "/tasks?internal=1")
    assert "show mutexcron's own codes (1)" in tasks_page and "mutexcron.trigger" not in tasks_page.split("<table")[1]
    assert "mutexcron.trigger <span class=\"muted\">(3 codes, one per bucket of job ids)</span>" in with_internal
    assert trigger_code(jobs[0]) not in with_internal.split("show mutexcron")[0]


def test_the_event_feed_node_states_and_folded_tracebacks_on_the_overview_job_and_task_pages(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/dash.db"
    populate(url)
    locks = lock_store_from_url(url)
    run = next(r for r in locks.history("billing", "send_reminders") if r.outcome == "error")
    feed = feed_store_for(locks)
    assert feed is not None
    traceback = 'Traceback (most recent call last):\n  File "jobs.py", line 9, in send_reminders\nValueError: boom\n'
    feed.append([
        FeedEvent("run_failed", NODE.node_id, "billing", "job send_reminders failed on node-a:1:aa: ValueError: boom",
                  traceback, {"job": "send_reminders", "token": run.token, "fire_time": str(run.fire_time), "error": "boom"}),
        FeedEvent("task_failed", NODE.node_id, "email.send", "task email.send/order-1 attempt 1 failed for good",
                  traceback.replace("send_reminders", "send_email"), {"key": "order-1", "attempt": 1, "duration": 0.25}),
        FeedEvent("node_stopped", NODE.node_id, None, f"node {NODE.node_id} stopped cleanly"),
    ])  # fmt: skip
    locks.close()
    overview, failed_only, job_page, recent, task_page = pages(
        url, "/", "/?kind=run_failed", "/history?lock=billing&job=send_reminders", "/history?outcome=error",
        "/task?code=email.send&key=order-1",
    )  # fmt: skip
    assert '<span class="badge muted">stopped</span>' in overview, "a clean stop is recorded as such"
    assert "job send_reminders failed on node-a:1:aa" in overview and "node node-a:1:aa stopped cleanly" in overview
    assert "stopped cleanly" not in failed_only.split('id="s-events"')[1], "the feed is filtered by kind"
    assert '<details class="error"><summary>ValueError: boom</summary><pre>Traceback' in job_page
    assert "<h1>Recent runs</h1>" in recent and "in send_reminders" in recent and "success</span>" not in recent
    assert "<h3>attempts</h3>" in task_page and "in send_email" in task_page and "failed</span>" in task_page


def test_the_nodes_table_shows_each_nodes_share_fair_share_weight_and_tags(tmp_path: Path) -> None:
    """Issue 33: the Overview's nodes, each with its share, its fair share by weight, its weight and tags."""
    url = f"sqlite:///{tmp_path}/dash.db"
    populate(url)
    locks = lock_store_from_url(url)
    try:
        assert locks.renew_many(NODE, {"billing": 1, "reports": 1}, presence=Presence("0.1.0", traits=NodeTraits(3.0, ("eu",))))
        assert locks.renew_many(Node("node-b:2:bb", "10.0.0.9"), {}, presence=Presence("0.1.0")) == set()
    finally:
        locks.close()
    (overview,) = pages(url, "/")
    nodes = overview.split('id="s-nodes"')[1].split("</table>")[0]
    assert "<th>fair share</th><th>weight</th><th>tags</th>" in nodes.replace("\n", ""), nodes
    row_a, row_b = (nodes.split(f">{name}</a>")[1].split("</tr>")[0] for name in (NODE.node_id, "node-b:2:bb"))
    assert "<td>2 of 2 (100%)</td><td>2</td><td>3</td><td>eu</td>" in row_a, row_a
    assert "<td>0 of 2 (0%)</td><td>1</td><td>1</td><td>-</td>" in row_b, row_b
