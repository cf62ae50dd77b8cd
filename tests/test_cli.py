"""The `mutexcron` command: startup errors (exit 2, file:line, no traceback), status, ddl, run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from mutexcron.cli.main import main
from mutexcron.locks import Node, RunInfo, lock_store_from_url

pytestmark = pytest.mark.sqlite


def write(tmp_path: Path, body: str, name: str = "jobs.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def run_cli(*args: str, cwd: Path, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mutexcron", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


GOOD = """
    from mutexcron import MutexScheduler
    sched = MutexScheduler()

    @sched.mutex(lock="tick", unactive_interval=2)
    @sched.cron_schedule(second="*")
    def tick(**attrs):
        return {"n": attrs.get("n", 0) + 1}
"""


@pytest.mark.parametrize(
    ("body", "line", "problem"),
    [
        ("x = 1\ndef broken(:\n    pass\n", 2, "syntax error"),
        ("import no_such_module_here\n", 1, "ModuleNotFoundError: No module named 'no_such_module_here'"),
        (
            "from mutexcron import MutexScheduler\nsched = MutexScheduler()\n\n@sched.cron_schedule(minute='*/75')\n"
            "def job():\n    pass\n",
            4,
            "bad cron schedule for job 'job'",
        ),
        ("raise RuntimeError('config missing')\n", 1, "RuntimeError: config missing"),
    ],
    ids=["syntax", "import", "cron-field", "exception"],
)
def test_bad_jobs_file_exits_2_with_file_line_and_no_traceback(tmp_path: Path, body: str, line: int, problem: str) -> None:
    path = tmp_path / "jobs.py"
    path.write_text(body)
    result = run_cli("run", str(path), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"jobs.py:{line}: " in result.stderr and problem in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_traceback_only_with_debug(tmp_path: Path) -> None:
    path = write(tmp_path, "raise RuntimeError('config missing')\n")
    result = run_cli("run", str(path), "--log-level", "debug", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" in result.stderr


def test_missing_file_no_scheduler_and_several_schedulers(tmp_path: Path) -> None:
    result = run_cli("run", "nope.py", cwd=tmp_path)
    assert result.returncode == 2 and "nope.py: jobs file not found" in result.stderr
    write(tmp_path, "x = 1\n", "empty.py")
    result = run_cli("run", "empty.py", cwd=tmp_path)
    assert result.returncode == 2 and "no MutexScheduler found" in result.stderr
    write(tmp_path, "from mutexcron import MutexScheduler\na = MutexScheduler()\nb = MutexScheduler()\n", "two.py")
    result = run_cli("run", "two.py", cwd=tmp_path)
    assert result.returncode == 2 and "several MutexSchedulers (a, b)" in result.stderr and "two.py:NAME" in result.stderr


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("ftp://user:hunter2@host/x", "scheme 'ftp' is not one of"),
        ("nonsense", "scheme '(none)'"),
        ("postgresql://user:hunter2@host:notaport/db", "cannot parse lock URL"),
        ("sqlite://", "in-memory SQLite"),
    ],
)
def test_bad_lock_url_exits_2_naming_schemes_and_hiding_password(tmp_path: Path, url: str, problem: str) -> None:
    path = write(tmp_path, GOOD)
    result = run_cli("run", str(path), "--lock-url", url, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert problem in result.stderr and "hunter2" not in result.stderr


def test_status_table_json_and_masked_password(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/locks.db"
    store = lock_store_from_url(url)
    node = Node("web-1:42:abcd", "10.1.2.3")
    token = store.acquire_or_renew("billing", node, ttl=30).token
    store.hand_off("billing", node, token, {"cursor": 300, "note": "x" * 100}, RunInfo(0.5, "ValueError: bad row"))
    store.acquire_or_renew("reports", node, ttl=30)
    store.release("reports", node, 1)
    store.close()
    runner = CliRunner()
    result = runner.invoke(main, ["status", "--lock-url", url])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("lock store: sqlite:///") and "(2 locks)" in lines[0]
    assert lines[1].split()[:5] == ["NAME", "HOLDER", "ACTIVE_IP", "HEARTBEAT", "STATE"]
    billing = next(line for line in lines if line.startswith("billing"))
    assert "web-1:42:abcd" in billing and "10.1.2.3" in billing and " active " in billing
    assert "ValueError: bad row" in billing and '{"cursor": 300' in billing and "…" in billing
    assert " released " in next(line for line in lines if line.startswith("reports"))
    data = json.loads(runner.invoke(main, ["status", "--lock-url", url, "--json"]).output)
    by_name = {lock["name"]: lock for lock in data["locks"]}
    assert by_name["billing"]["attrs"]["cursor"] == 300 and by_name["billing"]["token"] == 1
    assert by_name["reports"]["state"] == "released" and by_name["reports"]["token"] == 1
    masked = runner.invoke(main, ["status", "--lock-url", "postgresql://bob:hunter2@127.0.0.1:1/x"])
    assert masked.exit_code == 1 and "hunter2" not in masked.output and "bob:***@" in masked.output


def test_ddl_prints_the_schema(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["ddl", "--lock-url", f"sqlite:///{tmp_path}/x.db?table=my_locks"])
    assert result.exit_code == 0 and "CREATE TABLE IF NOT EXISTS my_locks" in result.output


def test_run_until_sigterm_releases_the_lock(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    url = f"sqlite:///{tmp_path}/run.db"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mutexcron", "run", str(path), "--lock-url", url, "--node-id", "solo"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "MUTEXCRON_LOCK_URL": "ftp://ignored-because-the-flag-wins"},
    )
    try:
        deadline = time.monotonic() + 15
        store = lock_store_from_url(url)
        while time.monotonic() < deadline:
            rec = store.read("tick") if os.path.exists(tmp_path / "run.db") else None
            if rec is not None and rec.attrs.get("n", 0) >= 2:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the job never ran twice")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "released lock 'tick' (token 1)" in out
    rec = store.read("tick")
    assert rec is not None and rec.holder is None and rec.token == 1
    store.close()


@pytest.mark.parametrize("example", ["jobs.py", "fenced_export.py", "job_group.py"])
def test_examples_load_and_guard_their_jobs(example: str) -> None:
    from mutexcron.cli.loader import load_scheduler
    from mutexcron.guard.job import GuardedJob

    sched = load_scheduler(str(Path(__file__).parent.parent / "examples" / example))
    guarded = [job for job in sched.get_jobs() if isinstance(job.func, GuardedJob)]
    assert guarded, f"{example} has guarded jobs"


BLOCKING = """
from mutexcron import BlockingMutexScheduler
sched = BlockingMutexScheduler(unactive_interval=30)

@sched.mutex()
@sched.cron_schedule(second="*")
def tick(**attrs):
    return {"n": attrs.get("n", 0) + 1}
"""


def test_sigterm_stops_a_blocking_scheduler_gracefully_and_releases(tmp_path: Path) -> None:
    """Issue 8, B10: BlockingMutexScheduler.start() holds the main thread; SIGTERM must still stop it
    and release the lease (else failover waits a whole lease, here 30 s)."""
    path = write(tmp_path, BLOCKING)
    url = f"sqlite:///{tmp_path}/blocking.db"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mutexcron", "run", str(path), "--lock-url", url, "--node-id", "solo"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    store = lock_store_from_url(url)
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            rec = store.read("tick") if os.path.exists(tmp_path / "blocking.db") else None
            if rec is not None and rec.attrs.get("n", 0) >= 1:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the job never ran")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "SIGTERM received" in out and "released lock 'tick'" in out, out
    rec = store.read("tick")
    assert rec is not None and rec.holder is None
    store.close()


SELF_SIGNALLING = """
import signal
import threading

from mutexcron import {cls}

sched = {cls}(unactive_interval=30)


@sched.mutex()
@sched.cron_schedule(month=1, day=1)  # far away: the scheduler's own loop sleeps until then
{kind}def yearly(**attrs):
    return {{"n": attrs.get("n", 0) + 1}}


def _terminate_from_this_thread():
    # The kernel may hand a process's SIGTERM to any of its threads; this makes it one that is not
    # the main thread, deterministically, once the node is up with its handler installed.
    while signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or not sched.running:
        threading.Event().wait(0.05)
    threading.Event().wait(0.5)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)


threading.Thread(target=_terminate_from_this_thread, daemon=True).start()
"""


@pytest.mark.parametrize(
    ("cls", "kind"),
    [("MutexScheduler", ""), ("BlockingMutexScheduler", ""), ("AsyncIOMutexScheduler", "async ")],
)
def test_a_sigterm_taken_by_another_thread_still_stops_the_node(tmp_path: Path, cls: str, kind: str) -> None:
    """Python runs signal handlers on the main thread only: a SIGTERM the kernel gives to a handler
    thread must still wake the main thread's wait, ours or the scheduler loop's sleeping until a
    fire time months away (it once slept on until a second signal or the next job)."""
    path = tmp_path / "jobs.py"
    path.write_text(SELF_SIGNALLING.format(cls=cls, kind=kind))
    url = f"sqlite:///{tmp_path}/thread.db"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mutexcron", "run", str(path), "--lock-url", url, "--node-id", "solo"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
        pytest.fail(f"the node did not stop on a SIGTERM taken by another thread:\n{out}")
    assert proc.returncode == 0, out
    assert "SIGTERM received" in out and "stopped" in out, out
