"""``resume --catch-up`` and ``trigger`` with real ``mutexcron run`` nodes tell the truth (issue #32, C1
and C2).

C1: ``pause LOCK`` then ``resume --catch-up`` said "catching up once now" and did not wait; the
request's fire time (its due, the store's clock) was often past a later fire time that a scheduled
run had claimed while the request waited for the holder, so the store refused it, the holder logged
"fire time ... already ran ... not running it again" (no run had that fire time) and the request
ended as that scheduled run. Now the catch-up runs, or every voice (the command, the holder's
log, the dashboard) says it was merged into the run at the fire time that did run.

C2: two apps' nodes (two jobs files) on one lock store: a request goes to a node that defines the
job, a node that does not never fails it, and a failed catch-up never answers a new request.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from mutexcron.dashboard import create_app
from mutexcron.guard.run_requests import request_runs
from mutexcron.locks import lock_store_from_url
from tests.backends import backend_params_full_matrix, cleanup_redis, drop_store_tables, require_server
from tests.test_dashboard import TOKEN, action_headers, call

pytestmark = pytest.mark.cluster

LOCK, JOB = "nightly-report", "nightly_report"
INTERVAL = 5  # seconds: long enough for a catch-up seen within a second or two to run in its own right

APP = textwrap.dedent(
    """
    import json, os
    from mutexcron import MutexScheduler, current_lease
    sched = MutexScheduler()

    @sched.mutex(lock={lock!r}, unactive_interval=3)
    @sched.interval_schedule(seconds={interval}, id={job!r})
    def job():
        lease = current_lease()
        line = {{"job": {job!r}, "node": lease.node_id, "fire_time": lease.fire_time.isoformat()}}
        with open(os.environ["CATCH_UP_OUT"], "a") as out:
            out.write(json.dumps(line) + "\\n")
    """
)


@pytest.fixture
def url(kind: str, tmp_path: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path}/t.db"
        return
    base = require_server(kind)
    tag = secrets.token_hex(3)
    sep = "&" if "?" in base else "?"
    if kind == "redis":
        yield f"{base}{sep}namespace=catch-up-{tag}"
        cleanup_redis(f"{base}{sep}namespace=catch-up-{tag}")
        return
    yield f"{base}{sep}table=mc_catch_up_{tag}&tasks_table=mc_catch_up_tasks_{tag}"
    drop_store_tables(f"{base}{sep}table=mc_catch_up_{tag}&tasks_table=mc_catch_up_tasks_{tag}")


class Nodes:
    """``mutexcron run`` nodes of one or more jobs files on one lock store."""

    def __init__(self, url: str, workdir: Path) -> None:
        self.url, self.workdir = url, workdir
        self.out = workdir / "runs.jsonl"
        self.env = {**os.environ, "MUTEXCRON_LOCK_URL": url, "CATCH_UP_OUT": str(self.out)}
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, jobs_file: str, *node_ids: str) -> None:
        for node in node_ids:
            command = [sys.executable, "-m", "mutexcron", "run", jobs_file, "--node-id", node]
            with open(self.workdir / f"{node}.log", "wb") as log:
                self.procs.append(subprocess.Popen(command, cwd=self.workdir, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "mutexcron", *args], cwd=self.workdir, env=self.env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    def runs(self, job: str = JOB) -> list[dict[str, Any]]:
        lines = self.out.read_text().splitlines() if self.out.exists() else []
        return [row for row in map(json.loads, lines) if row["job"] == job]

    def log(self, node: str) -> str:
        return (self.workdir / f"{node}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.workdir.glob("*.log")))

    def wait_for_runs(self, count: int, timeout: float = 45) -> None:
        deadline = time.monotonic() + timeout
        while len(self.runs()) < count and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(self.runs()) >= count, f"fewer than {count} runs of {JOB}\n{self.logs()}"

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def nodes(url: str, tmp_path: Path) -> Iterator[Nodes]:
    (tmp_path / "app_a.py").write_text(APP.format(lock=LOCK, job=JOB, interval=INTERVAL))
    (tmp_path / "app_b.py").write_text(APP.format(lock="billing", job="billing_sync", interval=INTERVAL))
    made = Nodes(url, tmp_path)
    try:
        yield made
    finally:
        made.stop()


def _iso(text: str) -> datetime:
    return datetime.fromisoformat(text)


def assert_told_truly(nodes: Nodes, said: str, asked: datetime | None = None) -> None:
    """``said`` (the command's line for the job) is "ran at fire time X on N" with X the request's
    own fire time, or "merged into the run at fire time Y on N" with no run at the request's:
    each as the history and the runs themselves show, and each fire time ran once."""
    ran = re.search(r"ran at fire time (\S+) on (\S+): success", said)
    merged = re.search(r"merged into the run at fire time (\S+) on (\S+) \(.* request of (\S+) waited", said)
    assert ran or merged, f"{said!r}\n{nodes.logs()}"
    match = ran or merged
    assert match is not None
    fire_time, node = _iso(match[1]), match[2]
    wanted = asked if asked is not None else (_iso(merged[3]) if merged else fire_time)
    runs = nodes.runs()
    assert sum(_iso(r["fire_time"]) == fire_time and r["node"] == node for r in runs) == 1, (said, runs)
    assert len({r["fire_time"] for r in runs}) == len(runs), f"a fire time ran twice: {runs}"
    history = lock_store_from_url(nodes.url)
    try:
        recorded = [r for r in history.history(LOCK, JOB) if r.fire_time == fire_time]
    finally:
        history.close()
    assert len(recorded) == 1 and recorded[0].node == node and recorded[0].outcome == "success", recorded
    if ran:
        assert fire_time == wanted, f"a catch-up runs at its own fire time: {said!r}"
    else:
        assert fire_time > wanted and not [r for r in runs if _iso(r["fire_time"]) == wanted], runs
    for node_id in ("a0", "a1", "a2"):
        text = nodes.log(node_id) if (nodes.workdir / f"{node_id}.log").exists() else ""
        assert f"fire time {wanted.isoformat(' ')} already ran" not in text, text[-3000:]  # the old, false line
        assert "another process runs with node id" not in text, text[-3000:]  # C5's false diagnosis


def pause_and_let_a_fire_time_pass(nodes: Nodes) -> None:
    paused = nodes.cli("pause", LOCK)
    assert paused.returncode == 0, paused.stdout + paused.stderr
    time.sleep(INTERVAL + 1.5)  # a fire time passes unclaimed


@pytest.mark.parametrize("kind", backend_params_full_matrix(("sqlite",), ("postgresql", "mysql", "redis")))
def test_resume_with_catch_up_runs_it_or_says_what_it_was_merged_into(nodes: Nodes) -> None:
    nodes.start("app_a.py", "a0", "a1", "a2")
    nodes.wait_for_runs(1)  # a job that ran under the lock is caught up
    for _ in range(2):
        pause_and_let_a_fire_time_pass(nodes)
        resumed = nodes.cli("resume", LOCK, "--catch-up", "--timeout", "60")
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert f"catch-up requested: {JOB}" in resumed.stdout, resumed.stdout
        line = next((x for x in resumed.stdout.splitlines() if x.startswith(f"{JOB}: ")), "")
        assert_told_truly(nodes, line)

    # The dashboard's "Resume + catch up": the answer names each request's fire time, and the
    # outcome it follows says ran or merged, as the history does.
    pause_and_let_a_fire_time_pass(nodes)
    app = create_app(nodes.url, action_token=TOKEN)
    headers = {**action_headers(app), "Origin": "http://127.0.0.1:8465"}
    try:
        status, _, body = call(app, "/api/actions/resume", "POST", {"lock": LOCK, "by": "bob", "catch_up": True}, headers)
        assert status == 200, body
        answer = json.loads(body)
        assert "catching up once now" not in answer["message"] and f"catch-up requested: {JOB}" in answer["message"]
        asked = answer["fire_times"][JOB]
        deadline, outcome = time.monotonic() + 60, {"state": "queued"}
        while outcome["state"] in ("queued", "running") and time.monotonic() < deadline:
            time.sleep(0.3)
            query = f"job={JOB}&lock={LOCK}&fire_time={asked.replace('+', '%2B')}"
            outcome = json.loads(call(app, f"/api/trigger?{query}")[2])
    finally:
        app.close()
    assert outcome["state"] == "success", f"{outcome}\n{nodes.logs()}"
    where = f"fire time {outcome['fire_time']} on {outcome['node']}"
    said = f"merged into the run at {where} (a request of {asked} waited)" if outcome["merged"] else f"ran at {where}: success"
    assert_told_truly(nodes, said, _iso(asked))


@pytest.mark.parametrize("kind", backend_params_full_matrix(("sqlite",), ("postgresql",)))
def test_two_apps_on_one_store_a_request_runs_on_the_app_that_defines_it_and_a_failed_one_blocks_nothing(
    nodes: Nodes,
) -> None:
    nodes.start("app_b.py", "b0", "b1")  # the other app's nodes first: they see every request too
    nodes.start("app_a.py", "a0")
    nodes.wait_for_runs(1)
    pause_and_let_a_fire_time_pass(nodes)
    resumed = nodes.cli("resume", LOCK, "--catch-up", "--timeout", "60")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    line = next((x for x in resumed.stdout.splitlines() if x.startswith(f"{JOB}: ")), "")
    assert_told_truly(nodes, line)
    assert re.search(r" on a0[ :]", line), line  # app A's node ran it

    # A catch-up that fails (its lock was paused again before the holder saw it) ...
    assert nodes.cli("pause", LOCK).returncode == 0
    time.sleep(1.0)  # the holder sees the pause at its next renewal
    request_runs(nodes.url, LOCK, [JOB])
    deadline = time.monotonic() + 30
    while "lock 'nightly-report' is paused" not in _failed_request(nodes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "lock 'nightly-report' is paused" in _failed_request(nodes), nodes.logs()
    assert nodes.cli("resume", LOCK).returncode == 0
    # ... never answers a new `mutexcron trigger`, nor a new catch-up.
    triggered = nodes.cli("trigger", JOB, "--timeout", "60")
    assert triggered.returncode == 0, triggered.stdout + triggered.stderr + nodes.logs()
    assert_told_truly(nodes, triggered.stdout.strip())
    pause_and_let_a_fire_time_pass(nodes)
    again = nodes.cli("resume", LOCK, "--catch-up", "--timeout", "60")
    assert again.returncode == 0 and "not run" not in again.stdout, again.stdout
    assert_told_truly(nodes, next(x for x in again.stdout.splitlines() if x.startswith(f"{JOB}: ")))
    for node in ("b0", "b1"):  # the other app's nodes ran, failed and logged nothing of it
        text = nodes.log(node)
        assert JOB not in text and "Traceback" not in text, text[-3000:]
    assert not [r for r in nodes.runs() if r["node"].startswith("b")]
    assert nodes.runs("billing_sync"), "the other app ran its own job meanwhile"


def _failed_request(nodes: Nodes) -> str:
    listed = nodes.cli("tasks", "list", "--json", "--state", "failed")
    return listed.stdout if listed.returncode == 0 else listed.stderr


@pytest.mark.parametrize("kind", backend_params_full_matrix(("sqlite", "postgresql"), ("mysql", "redis")))
def test_two_apps_on_one_store_the_other_apps_nodes_never_claim_a_request(nodes: Nodes) -> None:
    """A request of app A's job goes only to app A's nodes: app B's nodes never claim it (before,
    every node claimed every request, and B's deferred it again and again: its attempts counted up
    under b0 and b1 while it waited for A), and A's node runs it as soon as it holds the lock."""
    nodes.start("app_b.py", "b0", "b1")
    wait_for_lock(nodes, "billing")  # app B's nodes are up and looking for requests
    asked = subprocess.Popen([sys.executable, "-m", "mutexcron", "trigger", JOB, "--force", "--timeout", "90"],
                             cwd=nodes.workdir, env=nodes.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        request = wait_for_request(nodes)
        time.sleep(3.0)  # app B's nodes look for requests once a second: three looks at least
        request = wait_for_request(nodes)
        assert request["attempt"] == 0 and request["owner"] is None and request["state"] == "queued", (request, nodes.logs())
        started = time.monotonic()
        nodes.start("app_a.py", "a0")
        out, err = asked.communicate(timeout=120)
    finally:
        if asked.poll() is None:
            asked.kill()
            asked.communicate()
    assert asked.returncode == 0, out + err + nodes.logs()
    assert f"{JOB}: ran at fire time" in out and out.strip().endswith(": success"), out
    assert time.monotonic() - started < 60, "app A's node ran it once it had started and taken the lock"
    assert [r["node"] for r in nodes.runs()] and all(r["node"] == "a0" for r in nodes.runs()), nodes.runs()
    for node in ("b0", "b1"):
        assert JOB not in nodes.log(node), nodes.log(node)[-3000:]


def wait_for_lock(nodes: Nodes, lock: str, timeout: float = 45) -> None:
    store = lock_store_from_url(nodes.url)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            record = store.read(lock)
            if record is not None and record.holder is not None:
                return
            time.sleep(0.2)
    finally:
        store.close()
    raise AssertionError(f"no node took {lock!r}\n{nodes.logs()}")


def wait_for_request(nodes: Nodes, timeout: float = 30) -> dict[str, Any]:
    """The trigger request of ``JOB``, whatever its code (every field, as `mutexcron tasks list --json`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = nodes.cli("tasks", "list", "--json", "--key-contains", JOB)
        found = [t for t in json.loads(listed.stdout or "[]") if t["key"] == JOB and t["state"] != "done"]
        if found:
            return dict(found[0])
        time.sleep(0.2)
    raise AssertionError(f"no request of {JOB}\n{nodes.logs()}")
