"""Configuration that would silently break "once", and operator commands that would mislead (issue 25).

The default SQLite store and whom it joins, ``run --lock-url`` as the store of every default-URL
object of the jobs file, SQL URL option typos, ``run --startup-timeout``, read-only ``status`` and
``history``, and live or stale nodes in ``status``.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from mutexcron import MutexScheduler
from mutexcron.cli.main import main
from mutexcron.errors import ConfigurationError
from mutexcron.locks import FireClaim, Node, Presence, lock_store_from_url
from mutexcron.tasks import task_store_from_url
from tests.backends import require_server
from tests.redis_servers import free_port

pytestmark = pytest.mark.sqlite

cli_main = importlib.import_module("mutexcron.cli.main")  # the module (the package's `main` is the command)

WEB1 = Node("web-1:1:aaaa", "10.0.0.1")
WEB2 = Node("web-2:2:bbbb", "10.0.0.2")
WEB3 = Node("web-3:3:cccc", "10.0.0.3")


def write(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body))
    return path


def start_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    environ = {k: v for k, v in os.environ.items() if k != "MUTEXCRON_LOCK_URL"}
    return subprocess.Popen(
        [sys.executable, "-m", "mutexcron", *args],
        cwd=cwd,
        env={**environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(what: str, check: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return out


# -- 1: the default store names its file and whom it joins -------------------------------------------
def test_a_relative_sqlite_path_is_shown_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    store = lock_store_from_url("sqlite:///rel.db?table=t1")
    tasks = task_store_from_url("sqlite:///rel.db")
    try:
        assert store.masked_url == f"sqlite:///{tmp_path}/rel.db?table=t1"
        assert tasks.masked_url == f"sqlite:///{tmp_path}/rel.db"
        monkeypatch.chdir("/")  # the same file after a chdir
        store.acquire_or_renew("x", WEB1, ttl=5)
        assert (tmp_path / "rel.db").exists() and not Path("/rel.db").exists()
    finally:
        store.close()
        tasks.close()


def test_start_warns_that_the_default_store_joins_only_this_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MUTEXCRON_LOCK_URL", raising=False)
    for configured in (None, f"sqlite:///{tmp_path}/chosen.db"):
        caplog.clear()
        sched = MutexScheduler(lock_url=configured, triggers=False)
        with caplog.at_level(logging.INFO, logger="mutexcron.scheduler"):
            sched.start()
            sched.shutdown()
        lines = [r for r in caplog.records if "only joins processes on this host" in r.getMessage()]
        assert len(lines) == 1, caplog.text
        if configured is None:
            assert lines[0].levelno == logging.WARNING and f"{tmp_path}/mutexcron.db" in lines[0].getMessage()
            assert "no lock store configured" in lines[0].getMessage()
        else:
            assert lines[0].levelno == logging.INFO and f"{tmp_path}/chosen.db" in lines[0].getMessage()
        assert f"using lock store sqlite:///{tmp_path}/" in caplog.text


def test_status_prints_the_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    store = lock_store_from_url("sqlite:///mutexcron.db")
    store.acquire_or_renew("billing", WEB1, ttl=30)
    store.close()
    result = CliRunner().invoke(main, ["status", "--lock-url", "sqlite:///mutexcron.db"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"lock store: sqlite:///{tmp_path}/mutexcron.db  (1 lock)")


# -- 2: run --lock-url is the store of every default-URL object ---------------------------------------
JOBS_WITH_DEFAULTS = """
    import os
    from mutexcron import Mutex, MutexScheduler, TaskPool
    sched = MutexScheduler({args})
    mutex, pool = Mutex(), TaskPool()
    with open(os.environ["REPORT"], "w") as out:
        out.write(mutex.store.url + "\\n" + pool.store.url + "\\n")

    @sched.mutex(lock="tick", unactive_interval=2)
    @sched.cron_schedule(second="*")
    def tick():
        open(os.environ["REPORT"] + ".ran", "w").close()  # the node started: its start-up warnings are out
"""


def test_run_lock_url_is_the_store_of_mutex_and_taskpool_in_the_jobs_file(tmp_path: Path) -> None:
    jobs = write(tmp_path / "jobs.py", JOBS_WITH_DEFAULTS.format(args=""))
    report = tmp_path / "report.txt"
    url = f"sqlite:///{tmp_path}/run.db"
    proc = start_cli("run", str(jobs), "--lock-url", url, "--startup-timeout", "0", cwd=tmp_path, env={"REPORT": str(report)})
    try:
        wait_for("the jobs file's report", lambda: report.exists() and report.read_text().count("\n") == 2)
    finally:
        out = stop(proc)
    assert report.read_text().splitlines() == [url, url], out
    assert not (tmp_path / "mutexcron.db").exists()
    assert "uses the store" not in out


def test_run_warns_when_a_default_object_and_the_scheduler_use_different_stores(tmp_path: Path) -> None:
    jobs = write(tmp_path / "jobs.py", JOBS_WITH_DEFAULTS.format(args=f'lock_url="sqlite:///{tmp_path}/sched.db"'))
    report = tmp_path / "report.txt"
    proc = start_cli("run", str(jobs), cwd=tmp_path, env={"REPORT": str(report)})
    try:
        wait_for("the jobs file's report", lambda: report.exists() and report.read_text().count("\n") == 2)
        wait_for("a first run of tick", (tmp_path / "report.txt.ran").exists, timeout=60)
    finally:
        out = stop(proc)
    for what in ("Mutex()", "TaskPool()"):
        assert f"{what} in the jobs file uses the store sqlite:///{tmp_path}/mutexcron.db, not the scheduler's" in out, out


# -- 4: SQL URL option typos ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("sqlite:///{tmp}/x.db?tabel=x", "SQLite"),
        ("mysql://root@127.0.0.1:3306/test?tabel=x", "MySQL"),
        ("postgresql://postgres@127.0.0.1:5432/test?tabel=x", "PostgreSQL"),
    ],
    ids=["sqlite", "mysql", "postgresql"],
)
def test_an_unknown_sql_url_option_is_refused_with_the_accepted_ones(tmp_path: Path, url: str, kind: str) -> None:
    url = url.format(tmp=tmp_path)
    with pytest.raises(ConfigurationError) as caught:
        lock_store_from_url(url)
    message = str(caught.value)
    assert f"unknown option 'tabel' in the {kind} URL" in message and "did you mean 'table'?" in message
    assert "mutexcron's options: table, tasks_table, pool_size, history" in message
    result = CliRunner().invoke(main, ["status", "--lock-url", url])
    assert result.exit_code == 2 and "unknown option 'tabel'" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "x.db").exists()


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:///{tmp}/x.db?table=t&timeout=3",
        "sqlite:///{tmp}/x.db?uri=true&mode=rwc",
        "mysql://root@127.0.0.1/test?charset=utf8mb4&ssl_ca=/etc/ca.pem&table=t&history=5",
        "postgresql://postgres@127.0.0.1/test?application_name=web&sslmode=prefer&tasks_table=t",
    ],
)
def test_driver_options_are_still_accepted(tmp_path: Path, url: str) -> None:
    lock_store_from_url(url.format(tmp=tmp_path)).close()


# -- 5: a store never reached at start: exit 1 after --startup-timeout, /healthz 503 meanwhile ----------
PLAIN_JOBS = """
    from mutexcron import MutexScheduler
    sched = MutexScheduler()

    @sched.mutex(lock="tick", unactive_interval=2)
    @sched.cron_schedule(second="*")
    def tick():
        open(os.environ["REPORT"] + ".ran", "w").close()  # the node started: its start-up warnings are out
"""


def _healthz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("mysql://nobody:wrong@{mysql}/test", id="mysql-access-denied", marks=pytest.mark.mysql),
        pytest.param("postgresql://postgres@{postgresql}/no_such_db_mc", id="pg-unknown-db", marks=pytest.mark.postgresql),
    ],
)
def test_a_store_never_reached_ends_the_run_with_status_1_after_the_startup_timeout(tmp_path: Path, url: str) -> None:
    for kind in ("mysql", "postgresql"):
        if "{" + kind + "}" in url:
            url = url.replace("{" + kind + "}", require_server(kind).split("@")[-1].split("/")[0])
    jobs = write(tmp_path / "jobs.py", PLAIN_JOBS)
    port = free_port()
    started = time.monotonic()
    proc = start_cli("run", str(jobs), "--lock-url", url, "--startup-timeout", "4", "--metrics-port", str(port), cwd=tmp_path)
    try:
        wait_for("/healthz to answer 503", lambda: _healthz(port) == 503 or proc.poll() is not None, timeout=20)
        assert proc.poll() is None, "the node exited before its startup timeout"
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, out
    assert time.monotonic() - started >= 4
    assert "has not answered once in 4s since start" in out and "(--startup-timeout)" in out
    assert "wrong" not in out.replace("a wrong URL", "")  # the password stays masked


class _Health:
    def __init__(self, reached: bool) -> None:
        self.reached = reached


def test_the_startup_watch_leaves_a_node_that_reached_its_store_alone() -> None:
    gave_up: list[int] = []
    stopper = SimpleNamespace(signalled=threading.Event(), give_up=gave_up.append)
    reached = SimpleNamespace(_leases=SimpleNamespace(health=_Health(True)), lock_url="sqlite:///x.db")
    cli_main._watch_first_contact(reached, stopper, 0.2)  # type: ignore[arg-type]
    never = SimpleNamespace(_leases=SimpleNamespace(health=_Health(False)), lock_url="sqlite:///x.db")
    cli_main._watch_first_contact(never, stopper, 0.2)  # type: ignore[arg-type]
    wait_for("the watch to give up", lambda: gave_up == [cli_main.EXIT_FAILURE], timeout=10)
    time.sleep(0.6)
    assert gave_up == [cli_main.EXIT_FAILURE]  # once, and only for the node that never reached its store


# -- 8: read-only commands create nothing -----------------------------------------------------------------
def test_status_and_history_say_no_such_file_or_table_and_create_nothing(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = f"sqlite:///{tmp_path}/none.db"
    for command in ("status", "history"):
        result = runner.invoke(main, [command, "--lock-url", missing])
        assert result.exit_code == 1 and f"no such file {tmp_path}/none.db" in result.output, result.output
    assert not (tmp_path / "none.db").exists()
    url = f"sqlite:///{tmp_path}/locks.db"
    store = lock_store_from_url(url)
    store.acquire_or_renew("billing", WEB1, ttl=30)
    store.close()
    for command in ("status", "history"):
        result = runner.invoke(main, [command, "--lock-url", f"{url}?table=biling"])
        assert result.exit_code == 1 and "no such table 'biling'" in result.output, result.output
    import sqlite3

    with sqlite3.connect(tmp_path / "locks.db") as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert not any(name.startswith("biling") for name in tables), tables


def test_status_of_a_store_with_tasks_and_no_lock_table_shows_the_tasks(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/tasks.db"
    tasks = task_store_from_url(url)
    tasks.add("promo", "sku-1", due=timedelta(0))
    tasks.close()
    result = CliRunner().invoke(main, ["status", "--lock-url", url])
    assert result.exit_code == 0, result.output
    assert "(no locks: no such table 'mutexcron_locks'" in result.output and "promo" in result.output
    import sqlite3

    with sqlite3.connect(tmp_path / "tasks.db") as conn:
        assert not conn.execute("SELECT name FROM sqlite_master WHERE name LIKE 'mutexcron_locks%'").fetchall()


@pytest.mark.postgresql
def test_status_creates_no_table_on_postgresql() -> None:
    url = f"{require_server('postgresql')}?table=mc_no_such_{os.getpid()}&tasks_table=mc_no_such_tasks_{os.getpid()}"
    result = CliRunner().invoke(main, ["status", "--lock-url", url])
    assert result.exit_code == 1 and f"no such table 'mc_no_such_{os.getpid()}'" in result.output
    import sqlalchemy

    engine = sqlalchemy.create_engine(require_server("postgresql").replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as conn:
            names = set(sqlalchemy.inspect(conn).get_table_names())
    finally:
        engine.dispose()
    pid = os.getpid()
    assert not {f"mc_no_such_{pid}", f"mc_no_such_{pid}_nodes", f"mc_no_such_{pid}_floor", f"mc_no_such_tasks_{pid}"} & names


# -- 9: live or stale nodes --------------------------------------------------------------------------------
def test_status_marks_stale_nodes_and_shows_only_the_locks_their_records_give_them(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/locks.db"
    store = lock_store_from_url(url)
    for node in (WEB1, WEB2):  # each held billing once, then released it
        token = store.acquire_or_renew("billing", node, ttl=30, claim=FireClaim.new("jobs.charge", 1)).token
        store.renew_many(node, {"billing": token}, presence=Presence("1.0"))
        store.release("billing", node, token)
    token = store.acquire_or_renew("billing", WEB3, ttl=30).token
    store.renew_many(WEB3, {"billing": token}, presence=Presence("1.0"))
    store.close()
    import sqlite3

    with sqlite3.connect(tmp_path / "locks.db") as conn:  # web-1 and web-2 were last seen 5 minutes ago
        conn.execute(
            "UPDATE mutexcron_locks_nodes SET seen = strftime('%Y-%m-%d %H:%M:%f', 'now', '-300 seconds') "
            "WHERE node_id IN (?, ?)",
            (WEB1.node_id, WEB2.node_id),
        )
    result = CliRunner().invoke(main, ["status", "--lock-url", url])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    header = lines.index("nodes (3 seen in the last 10 minutes):") + 1
    assert lines[header].split()[:3] == ["NODE", "STATE", "IP"]
    rows = {line.split()[0]: line for line in lines[header + 1 : header + 4]}
    assert rows[WEB3.node_id].split()[1] == "live" and rows[WEB3.node_id].rstrip().endswith("billing")
    for node in (WEB1, WEB2):
        assert rows[node.node_id].split()[1] == "stale" and "billing" not in rows[node.node_id], result.output
    data = json.loads(CliRunner().invoke(main, ["status", "--lock-url", url, "--json"]).output)
    states = {n["node_id"]: (n["state"], n["locks"]) for n in data["nodes"]}
    assert states == {WEB1.node_id: ("stale", []), WEB2.node_id: ("stale", []), WEB3.node_id: ("live", ["billing"])}


# -- 23: the suite drops what it creates ------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind", [pytest.param("postgresql", marks=pytest.mark.postgresql), pytest.param("mysql", marks=pytest.mark.mysql)]
)
def test_a_test_store_leaves_no_table_behind(kind: str, tmp_path: Path) -> None:
    from tests import leaks
    from tests.backends import open_backend, sql_tables

    require_server(kind)
    with open_backend(kind, tmp_path) as ctx:
        store = ctx.make()
        token = store.acquire_or_renew("x", WEB1, ttl=5).token
        store.renew_many(WEB1, {"x": token}, presence=Presence("1.0"))  # the presence table
        assert ctx.url is not None
        tasks = task_store_from_url(ctx.url)
        tasks.add("c", "k", due=timedelta(0))  # the task table
        tasks.close()
        from mutexcron.observability.feed import FeedEvent, feed_store_for

        feed = feed_store_for(store)
        assert feed is not None
        feed.append([FeedEvent("node_joined", "web-1", None, "web-1 joined")])  # the event feed's table
        created = {f"{kind}:{table}" for table in sql_tables(ctx.url)}
        assert len(created) == 5 and created <= leaks.snapshot()
    assert not created & leaks.snapshot()


# -- 22: the Celery example's broker is Celery's own setting -------------------------------------------
def test_the_celery_example_takes_its_broker_from_celery_broker_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util
    import types

    made: list[dict[str, Any]] = []

    class FakeCelery:
        def __init__(self, name: str, **options: Any) -> None:
            made.append({"name": name, **options})

        def task(self, **_options: Any) -> Any:
            return lambda func: func

    monkeypatch.setitem(sys.modules, "celery", types.SimpleNamespace(Celery=FakeCelery))
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://broker.example:6379/1")
    monkeypatch.setenv("MUTEXCRON_LOCK_URL", f"sqlite:///{tmp_path}/locks.db")
    path = Path(__file__).resolve().parents[1] / "examples" / "celery_feed_import.py"
    spec = importlib.util.spec_from_file_location("celery_feed_import_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.mutex.close()
    assert made == [{"name": "feeds", "broker": "redis://broker.example:6379/1"}]
    doc = module.__doc__ or ""
    assert "CELERY_BROKER_URL=" in doc and "MUTEXCRON_LOCK_URL=" in doc
    assert "MUTEXCRON_LOCK_URL=redis://cache:6379/0 celery" not in doc  # the lock store is no broker
