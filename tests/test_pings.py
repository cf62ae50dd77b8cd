"""Ping hooks for external monitors (``mutex(ping=...)``), against a local HTTP server."""

from __future__ import annotations

import base64
import logging
import re
import secrets
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_EXECUTED, EVENT_SCHEDULER_SHUTDOWN, SchedulerEvent

from mutexcron import EVENT_RUN_FINISHED, EVENT_RUN_STARTED, ConfigurationError, MutexConfig, MutexEvent, MutexScheduler
from mutexcron.observability.pings import PingSender, check_ping, ping_url, run_id
from mutexcron.urls import mask_path

pytestmark = pytest.mark.memory


# -- helpers ------------------------------------------------------------------------------------
class Recorder:
    """A local HTTP server that records each request's method and path (with its query)."""

    def __init__(self, port: int = 0, delay: float = 0.0) -> None:
        self.requests: list[tuple[str, str]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                recorder.requests.append((self.command, self.path))
                time.sleep(delay)
                body = b"OK"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def paths(self) -> list[str]:
        return [path for _method, path in self.requests]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    server = Recorder()
    yield server
    server.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def blackhole() -> Iterator[str]:
    """A URL whose server accepts connections (the kernel's backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


@pytest.fixture
def schedulers() -> Iterator[list[MutexScheduler]]:
    made: list[MutexScheduler] = []
    yield made
    for sched in made:
        if sched.running:
            sched.shutdown(wait=False)


def make(schedulers: list[MutexScheduler], url: str | None = None, node: str = "a") -> MutexScheduler:
    sched = MutexScheduler(lock_url=url or f"memory://pings-{secrets.token_hex(4)}", node_id=node, local_ip="10.0.0.1")
    schedulers.append(sched)
    return sched


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def runs_of(paths: list[str]) -> list[list[str]]:
    """The healthchecks-style pings grouped per run id, in order: [[suffix, ...], ...]."""
    runs: dict[str, list[str]] = {}
    for path in paths:
        parts = urlsplit(path)
        rid = parse_qs(parts.query)["rid"][0]
        uuid.UUID(rid)  # a UUID, as healthchecks.io requires
        suffix = parts.path.rsplit("/", 1)[-1]
        runs.setdefault(rid, []).append(suffix if suffix in ("start", "fail") else "success")
    return list(runs.values())


def run_event(code: int, job: str = "j", token: int = 1, **details: Any) -> MutexEvent:
    fire = datetime(2026, 1, 1, tzinfo=timezone.utc)
    return MutexEvent(code, lock="l", job_id=job, node="n", token=token, fire_time=fire, **details)


def ping_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "mutexcron" and re.search(r"\bpings? to\b", r.getMessage())]


# -- URLs ---------------------------------------------------------------------------------------
def test_healthchecks_urls_get_start_fail_and_the_run_id() -> None:
    rid = "0b0e1c2e-7a43-4b8e-9c56-2f1d8e0a6c31"
    base = "https://hc-ping.com/5f0e1c2e-aaaa-bbbb-cccc-2f1d8e0a6c31"
    assert ping_url(base, "start", job="j", lock="l", rid=rid) == f"{base}/start?rid={rid}"
    assert ping_url(base, "success", job="j", lock="l", rid=rid) == f"{base}?rid={rid}"
    assert ping_url(base + "/", "fail", job="j", lock="l", rid=rid) == f"{base}/fail?rid={rid}"
    slug = "https://hc-ping.com/KEY/{job}?create=1"
    assert (
        ping_url(slug, "start", job="a b#2", lock="l", rid=rid) == f"https://hc-ping.com/KEY/a%20b%232/start?create=1&rid={rid}"
    )


def test_a_state_template_is_filled_in_cronitor_style() -> None:
    template = "https://cronitor.link/p/KEY/{lock}-{job}?state={state}&series={rid}"
    urls = [ping_url(template, state, job="nightly", lock="g/1", rid="R") for state in ("start", "success", "fail")]
    assert urls == [
        "https://cronitor.link/p/KEY/g%2F1-nightly?state=run&series=R",
        "https://cronitor.link/p/KEY/g%2F1-nightly?state=complete&series=R",
        "https://cronitor.link/p/KEY/g%2F1-nightly?state=fail&series=R",
    ]


def test_run_id_is_one_uuid_per_run() -> None:
    start, end = run_event(EVENT_RUN_STARTED), run_event(EVENT_RUN_FINISHED, outcome="success")
    assert run_id(start) == run_id(end) and uuid.UUID(run_id(start))
    assert run_id(run_event(EVENT_RUN_STARTED, token=2)) != run_id(start)


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("https://hc-ping.com/5f0e1c2e-aaaa", "https://hc-ping.com/***"),
        ("https://hc-ping.com/KEY/slug?create=1", "https://hc-ping.com/***"),
        ("https://u:pw@cronitor.link:8443/p/KEY/job?state=run", "https://***@cronitor.link:8443/***"),
        ("https://tok3n@cronitor.link/p/job", "https://***@cronitor.link/***"),
        ("https://hc-ping.com", "https://hc-ping.com"),
        ("https://hc-ping.com/", "https://hc-ping.com"),
        ("hc-ping.com/5f0e1c2e", "***"),
    ],
)
def test_mask_path_keeps_only_scheme_and_host(url: str, masked: str) -> None:
    assert mask_path(url) == masked


# -- configuration ------------------------------------------------------------------------------
BAD_PINGS = [
    ("hc-ping.com/SECRET-UUID", "not an http:// or https:// URL"),
    ("ftp://hc-ping.com/SECRET-UUID", "not an http:// or https:// URL"),
    ("https:///SECRET-UUID", "not an http:// or https:// URL"),
    ("https://hc-ping.com/{uuid}/SECRET-UUID", r"unknown placeholders \['uuid'\]"),
    ("https://hc-ping.com/SECRET-UUID?rid={rid}", r"\{rid\} without \{state\}"),
    ("https://hc-ping.com/SECRET-UUID/{job!r}", "not a valid URL template"),
    ("https://hc-ping.com/SECRET-UUID/{", "not a valid URL template"),
    (42, "must be a URL string, not int"),
]


@pytest.mark.parametrize(("ping", "problem"), BAD_PINGS)
def test_a_bad_ping_is_a_configuration_error_at_decoration(ping: Any, problem: str) -> None:
    sched = MutexScheduler(lock_url="memory://pings-config")

    def nightly() -> None:
        pass

    for apply in (
        lambda: sched.mutex(ping=ping)(sched.interval_schedule(seconds=60, id="nightly")(nightly)),  # mutex above
        lambda: sched.interval_schedule(seconds=60, id="nightly")(sched.mutex(ping=ping)(nightly)),  # mutex below
        lambda: sched.add_job(nightly, "interval", seconds=60, id="nightly", mutex={"ping": ping}),
        lambda: sched.add_job(nightly, "interval", seconds=60, id="nightly", mutex=MutexConfig(ping=ping)),
    ):
        nightly.__dict__.pop("__mutexcron_jobs__", None)
        sched.remove_all_jobs()
        with pytest.raises(ConfigurationError, match=problem) as raised:
            apply()
        message = str(raised.value)
        assert re.search(r"job '[^']*nightly'", message), message
        assert "https://hc-ping.com/<uuid>" in message, "the message gives the fix"
        assert "SECRET-UUID" not in message, "the URL's path is a secret"
    assert not sched._guarded


def test_a_ping_on_a_function_not_scheduled_yet_is_checked_by_mutex_itself() -> None:
    sched = MutexScheduler(lock_url="memory://pings-config")

    def report() -> None:
        pass

    with pytest.raises(ConfigurationError, match=r"job '.*report'"):
        sched.mutex(ping="mailto:ops@example.com")(report)


def test_the_callable_lock_mode_cannot_ping() -> None:
    with pytest.raises(ConfigurationError, match="callable-lock mode"):
        MutexConfig(lock=dict, heartbeat=print, ping="https://hc-ping.com/x")


def test_good_pings_pass() -> None:
    check_ping("https://hc-ping.com/5f0e1c2e-aaaa", "j")
    check_ping("http://127.0.0.1:8000/ping/KEY/{job}-{lock}?create=1", "j")
    check_ping("https://cronitor.link/p/KEY/{job}?state={state}&series={rid}", "j")


# -- runs ---------------------------------------------------------------------------------------
def test_a_successful_run_pings_start_then_success_with_one_run_id(schedulers: list[MutexScheduler], recorder: Recorder) -> None:
    sched = make(schedulers)
    check = f"{recorder.url}/{uuid.uuid4()}"

    @sched.mutex(lock="ok", ping=check)
    @sched.interval_schedule(seconds=0.2)
    def ok() -> None:
        pass

    sched.start()
    wait_for(lambda: len(recorder.requests) >= 6)
    sched.shutdown()
    runs = runs_of(recorder.paths())
    assert len(runs) >= 3
    assert all(run == ["start", "success"] for run in runs), runs
    assert all(method == "GET" and path.startswith(urlsplit(check).path) for method, path in recorder.requests)
    assert sched._pings.failed == 0 and sched._pings.dropped == 0


def test_a_failing_run_pings_start_then_fail(schedulers: list[MutexScheduler], recorder: Recorder) -> None:
    sched = make(schedulers)
    errors: list[Any] = []
    sched.add_listener(errors.append, EVENT_JOB_ERROR)

    @sched.mutex(lock="boom", ping=f"{recorder.url}/{uuid.uuid4()}")
    @sched.interval_schedule(seconds=0.2)
    def boom() -> None:
        raise ValueError("boom")

    sched.start()
    wait_for(lambda: len(recorder.requests) >= 4)
    sched.shutdown()
    assert errors, "the job's error still reaches APScheduler's listeners"
    runs = runs_of(recorder.paths())
    assert all(run == ["start", "fail"] for run in runs), runs


def test_a_cronitor_template_given_to_add_job(schedulers: list[MutexScheduler], recorder: Recorder) -> None:
    sched = make(schedulers)
    sched.add_job(print, "interval", seconds=0.2, id="feed import", mutex=MutexConfig(
        lock="feeds", ping=recorder.url + "/p/KEY/{job}?state={state}&series={rid}"))  # fmt: skip
    sched.start()
    wait_for(lambda: len(recorder.requests) >= 4)
    sched.shutdown()
    first, second = (urlsplit(path) for path in recorder.paths()[:2])
    assert first.path == second.path == "/p/KEY/feed%20import"
    assert parse_qs(first.query)["state"] == ["run"] and parse_qs(second.query)["state"] == ["complete"]
    assert parse_qs(first.query)["series"] == parse_qs(second.query)["series"]


def test_the_standby_sends_no_pings(schedulers: list[MutexScheduler], recorder: Recorder) -> None:
    url = f"memory://pings-shared-{secrets.token_hex(4)}"
    skipped: list[Any] = []
    for node in ("a", "b"):
        sched = make(schedulers, url, node)

        @sched.mutex(lock="shared", ping=f"{recorder.url}/{node}", lock_else=skipped.append)
        @sched.interval_schedule(seconds=0.2, id="shared")
        def shared() -> None:
            pass

        sched.start()
    wait_for(lambda: len(recorder.requests) >= 6 and len(skipped) >= 3)
    for sched in schedulers:
        sched.shutdown()
    nodes = {urlsplit(path).path.split("/")[1] for path in recorder.paths()}
    assert len(nodes) == 1, f"only the holder pings: {nodes}"
    holder = next(s for s in schedulers if s.node_id in nodes)
    standby = next(s for s in schedulers if s is not holder)
    assert standby._pings.sent == standby._pings.failed == standby._pings.dropped == 0
    assert standby._pings.threads == [], "no ping thread on a node that never pinged"
    assert all(run == ["start", "success"] for run in runs_of(recorder.paths()))


def test_jobs_without_ping_start_no_thread(schedulers: list[MutexScheduler]) -> None:
    sched = make(schedulers)
    runs: list[int] = []

    @sched.mutex(lock="quiet")
    @sched.interval_schedule(seconds=0.1)
    def quiet() -> None:
        runs.append(1)

    sched.start()
    wait_for(lambda: len(runs) >= 2)
    sched.shutdown()
    assert sched._pings.threads == [] and sched._pings.sent == 0


# -- failures: never the job's problem ----------------------------------------------------------
def test_an_unreachable_monitor_logs_one_warning_then_ok_again(
    schedulers: list[MutexScheduler], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    port = free_port()  # closed: connections are refused
    secret = str(uuid.uuid4())
    sched = make(schedulers)
    runs: list[int] = []

    @sched.mutex(lock="down", ping=f"http://127.0.0.1:{port}/{secret}?create=1")
    @sched.interval_schedule(seconds=0.15, id="down")
    def down() -> None:
        runs.append(1)

    sched.start()
    wait_for(lambda: sched._pings.failed >= 6)
    assert len(runs) >= 3
    lines = ping_lines(caplog)
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, [r.getMessage() for r in lines]
    assert f"http://127.0.0.1:{port}/***" in lines[0].getMessage() and "'down'" in lines[0].getMessage()
    server = Recorder(port)  # the monitor is back
    try:
        wait_for(lambda: len(server.requests) >= 4)
        sched.shutdown()
    finally:
        server.close()
    lines = ping_lines(caplog)
    assert len(lines) == 2 and "ok again" in lines[1].getMessage(), [r.getMessage() for r in lines]
    assert secret not in caplog.text, "the ping URL's secret path is never logged"
    assert f"http://127.0.0.1:{port}/***" in lines[1].getMessage()


def test_a_hanging_monitor_never_delays_the_job(
    schedulers: list[MutexScheduler], blackhole: str, caplog: pytest.LogCaptureFixture
) -> None:
    sched = make(schedulers)
    sched._pings.timeout = 0.5
    secret = str(uuid.uuid4())
    ends: list[float] = []
    delays: list[float] = []
    sched.add_listener(lambda _event: delays.append(time.monotonic() - ends[-1]), EVENT_JOB_EXECUTED)

    @sched.mutex(lock="slow", ping=f"{blackhole}/{secret}")
    @sched.interval_schedule(seconds=0.1)
    def slow() -> None:
        ends.append(time.monotonic())

    sched.start()
    wait_for(lambda: len(delays) >= 8 and sched._pings.failed >= 1)
    sched.shutdown()
    # From the job's last line to APScheduler's "executed": the store's hand-off and the listeners,
    # the ping's among them. Each ping hangs for its 0.5 s timeout meanwhile.
    assert statistics.median(delays) < 0.005 and max(delays) < 0.1, delays
    assert len(ping_lines(caplog)) == 1 and "timed out" in ping_lines(caplog)[0].getMessage()
    assert secret not in caplog.text

    # The listener itself only queues: a run's ping costs microseconds even with the thread stuck.
    sender = PingSender(lambda _job: f"{blackhole}/{secret}", timeout=0.5)
    costs = []
    for token in range(20):
        started = time.perf_counter()
        sender(run_event(EVENT_RUN_STARTED, token=token))
        costs.append(time.perf_counter() - started)
    assert max(costs) < 0.005, costs
    sender.close(0)


def test_a_full_queue_drops_and_counts(blackhole: str, caplog: pytest.LogCaptureFixture) -> None:
    sender = PingSender(lambda _job: f"{blackhole}/x", timeout=0.3, maxsize=3)
    for token in range(10):
        sender(run_event(EVENT_RUN_STARTED, token=token))
    assert 6 <= sender.dropped <= 7
    dropping = [r for r in caplog.records if "dropping" in r.getMessage()]
    assert len(dropping) == 1 and dropping[0].levelno == logging.WARNING
    assert sender.flush(5)
    assert [r for r in caplog.records if "drained" in r.getMessage()]
    sender.close(0)


def test_shutdown_sends_the_pings_still_queued() -> None:
    slow = Recorder(delay=0.1)
    try:
        sender = PingSender(lambda _job: f"{slow.url}/x")
        for token in range(3):
            sender(run_event(EVENT_RUN_STARTED, token=token))
            sender(run_event(EVENT_RUN_FINISHED, token=token, outcome="error", error="E"))
        sender(SchedulerEvent(EVENT_SCHEDULER_SHUTDOWN))
        assert len(slow.requests) == 6 and sender.sent == 6
        assert runs_of(slow.paths()) == [["start", "fail"]] * 3
        wait_for(lambda: sender.threads == [], timeout=2)
        sender(run_event(EVENT_RUN_STARTED, token=9))  # a ping after shutdown starts the thread again
        assert sender.flush(5) and len(slow.requests) == 7
        sender.close(0)
    finally:
        slow.close()


# -- one slow monitor, and a deadline per ping (issue 22, items 10 and 16) ------------------------------
@pytest.fixture
def trickler() -> Iterator[str]:
    """A URL whose server answers one byte every 0.2 s, forever: a per-read timeout never fires."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            conn.recv(4096)
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                while not stop.wait(0.2):  # one byte of a header that never ends
                    conn.sendall(b"y")
            except OSError:
                return

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    listener.close()


def test_a_slow_monitor_delays_no_other_monitor_and_each_ping_has_a_whole_request_deadline(
    trickler: str, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    templates = {"slow": f"{trickler}/slow-check", "fast": f"{recorder.url}/fast-check"}
    sender = PingSender(templates.get, timeout=1.0)
    try:
        started = time.monotonic()
        for token in range(4):  # 4 s of the slow monitor's pings queued first
            sender(run_event(EVENT_RUN_STARTED, job="slow", token=token))
        sender(run_event(EVENT_RUN_STARTED, job="fast"))
        wait_for(lambda: len(recorder.requests) == 1, timeout=3.0)
        assert time.monotonic() - started < 3.0, "the fast monitor's ping did not wait for the slow one's"
        wait_for(lambda: sender.failed >= 1, timeout=4.0)  # a trickled answer is cut off at 1 s, not never
        lines = [r.getMessage() for r in ping_lines(caplog)]
        assert lines and "timed out" in lines[0] and "slow-check" not in caplog.text
    finally:
        sender.close(0)


@pytest.mark.parametrize("password", ["s3c ret", "pa/ss:w@rd", "hunter22"])
def test_a_ping_urls_password_is_sent_as_basic_auth_and_never_logged(
    password: str, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    closed = free_port()
    try:
        up = PingSender(lambda _job: f"http://mon:{password}@127.0.0.1:{server.server_address[1]}/check")
        up(run_event(EVENT_RUN_STARTED))
        assert up.flush(5) and up.sent == 1
        assert seen == ["Basic " + base64.b64encode(f"mon:{password}".encode()).decode()]
        down = PingSender(lambda _job: f"http://mon:{password}@127.0.0.1:{closed}/check", timeout=1.0)
        down(run_event(EVENT_RUN_STARTED))
        assert down.flush(5) and down.failed == 1
    finally:
        server.shutdown()
        server.server_close()
    assert [r for r in ping_lines(caplog) if f"http://***@127.0.0.1:{closed}/***" in r.getMessage()]
    # This test's own lines (another test's sender thread may still be logging meanwhile): the
    # password, and each piece of it, appears in none of them.
    ports = (str(closed), str(server.server_address[1]))
    mine = "\n".join(r.getMessage() for r in caplog.records if any(port in r.getMessage() for port in ports))
    assert mine
    for fragment in {password, *re.split(r"[ /:@]", password)} - {""}:
        assert fragment not in mine, mine
