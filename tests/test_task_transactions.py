"""Tasks inside the application's own transaction (mutexcron/tasks/transactions.py), on every SQL store.

``pool.add/cancel(..., transaction=...)`` commit with the caller's writes or not at all, on a
SQLAlchemy Connection, a Session and the driver's own DB-API connection; a committed add wakes a
sleeping worker; ``task.complete(conn)`` is the worker's fenced completion inside the handler's
transaction (a stale attempt's writes roll back with it); a process killed before its commit
leaves neither the business row nor the task. The cluster proof with real nodes is
tests/test_task_transactions_cluster.py.
"""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy.engine import Engine

from mutexcron import TaskPool
from mutexcron.errors import ConfigurationError
from mutexcron.tasks import AddResult
from mutexcron.tasks.handlers import Handler, Task
from mutexcron.tasks.stores.sql import SQLTaskStore
from mutexcron.tasks.worker import TaskWorker
from tests.backends import FakeClock, backend_params, drop_tasks_table, require_server
from tests.schedulers import wait_for

SQL_KINDS = ("sqlite", "mysql", "postgresql")
every_sql_store = pytest.mark.parametrize("kind", backend_params(*SQL_KINDS))
FORMS = ("connection", "session", "dbapi")
#: SQLAlchemy's driver for each store kind (the store's own drivers).
DRIVERS = {"sqlite": "sqlite+pysqlite", "mysql": "mysql+pymysql", "postgresql": "postgresql+psycopg"}
NODE = "node-tx:1:aaaa"


class Rollback(Exception):
    """Raised inside :meth:`App.transaction` to roll the transaction back."""


@dataclass
class App:
    """An application database with a business table, and a TaskPool on the same database."""

    kind: str
    url: str  # the task store's URL (a task table of this test's own)
    app_url: str  # the application's SQLAlchemy URL, same database
    engine: Engine
    biz: str
    pool: TaskPool

    @contextmanager
    def transaction(self, form: str) -> Iterator[tuple[Any, Callable[[int], None]]]:
        """``(what pool.add takes, write(n): a business row)`` in one transaction: committed at the
        end of the block, rolled back if it raises :class:`Rollback`."""
        insert = f"INSERT INTO {self.biz} (id) VALUES ({{n}})"
        if form == "dbapi":
            proxy = self.engine.raw_connection()
            raw = proxy.driver_connection
            try:

                def write(n: int) -> None:
                    cur = raw.cursor()
                    cur.execute(insert.format(n=int(n)))
                    cur.close()

                try:
                    yield raw, write
                except Rollback:
                    raw.rollback()
                else:
                    raw.commit()
            finally:
                proxy.close()
            return
        if form == "session":
            from sqlalchemy.orm import Session

            with Session(self.engine) as session:
                try:
                    with session.begin():
                        yield session, lambda n: session.execute(sqlalchemy.text(insert.format(n=int(n))))
                except Rollback:
                    pass
            return
        try:
            with self.engine.begin() as conn:
                yield conn, lambda n: conn.execute(sqlalchemy.text(insert.format(n=int(n))))
        except Rollback:
            pass

    def rows(self) -> list[int]:
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(sqlalchemy.text(f"SELECT id FROM {self.biz} ORDER BY id"))]


def app_urls(kind: str, tmp_path: Path) -> tuple[str, str]:
    """(the task store's base URL, the application's SQLAlchemy URL) on one database."""
    if kind == "sqlite":
        path = tmp_path / "app.db"
        return f"sqlite:///{path}", f"sqlite:///{path}"
    base = require_server(kind)
    return base, str(sqlalchemy.make_url(base).set(drivername=DRIVERS[kind]))


@pytest.fixture
def app(kind: str, tmp_path: Path) -> Iterator[App]:
    tag = secrets.token_hex(4)
    base, app_url = app_urls(kind, tmp_path)
    url = f"{base}{'&' if '?' in base else '?'}tasks_table=mc_txtasks_{tag}"
    engine = sqlalchemy.create_engine(app_url, connect_args={"timeout": 20} if kind == "sqlite" else {})
    biz = f"mc_biz_{tag}"
    with engine.begin() as conn:
        conn.execute(sqlalchemy.text(f"CREATE TABLE {biz} (id INTEGER PRIMARY KEY)"))
    pool = TaskPool(url)
    pool.store.ping()  # creates the task table
    try:
        yield App(kind, url, app_url, engine, biz, pool)
    finally:
        pool.close()
        with engine.begin() as conn:
            conn.execute(sqlalchemy.text(f"DROP TABLE IF EXISTS {biz}"))
        engine.dispose()
        drop_tasks_table(url)


# -- enqueue ---------------------------------------------------------------------------------------
@every_sql_store
@pytest.mark.parametrize("form", FORMS)
def test_a_task_added_in_a_transaction_exists_if_and_only_if_it_commits(app: App, form: str) -> None:
    with app.transaction(form) as (tx, write):
        write(1)
        assert app.pool.add("close", "1", timedelta(minutes=30), payload={"n": 1}, transaction=tx) == AddResult.INSERTED
        raise Rollback
    assert app.rows() == [] and app.pool.get("close", "1") is None  # neither the order nor its task

    with app.transaction(form) as (tx, write):
        write(2)
        assert app.pool.add("close", "2", timedelta(minutes=30), payload={"n": 2}, transaction=tx) == AddResult.INSERTED
        assert app.pool.get("close", "2") is None  # not visible outside the transaction before its commit
    task = app.pool.get("close", "2")
    assert app.rows() == [2] and task is not None and task.state == "queued" and task.payload == {"n": 2}
    assert timedelta(minutes=29) < task.due - app.pool.store.now() <= timedelta(minutes=30)


@every_sql_store
@pytest.mark.parametrize("form", FORMS)
def test_an_update_and_a_cancel_in_a_transaction_commit_with_it(app: App, form: str) -> None:
    app.pool.add("close", "7", timedelta(minutes=30), payload={"v": 1})
    app.pool.add("close", "8", timedelta(minutes=30))
    with app.transaction(form) as (tx, _):  # the existing task's path: the locked read, the decision, the write
        assert app.pool.add("close", "7", timedelta(hours=2), payload={"v": 2}, transaction=tx) == AddResult.REPLACED
        assert app.pool.add("close", "7", timedelta(hours=5), transaction=tx, on_conflict="earliest") == AddResult.KEPT
        assert app.pool.cancel("close", "8", transaction=tx) is True
        raise Rollback
    seven, eight = app.pool.get("close", "7"), app.pool.get("close", "8")
    assert seven is not None and seven.payload == {"v": 1} and eight is not None  # rolled back: both as they were
    with app.transaction(form) as (tx, _):
        assert app.pool.add("close", "7", timedelta(hours=2), payload={"v": 2}, transaction=tx) == AddResult.REPLACED
        assert app.pool.cancel("close", "8", transaction=tx) is True
        assert app.pool.cancel("close", "9", transaction=tx) is False
    seven = app.pool.get("close", "7")
    assert seven is not None and seven.payload == {"v": 2} and app.pool.get("close", "8") is None
    # A cancelled task (its tombstone) added again in a transaction.
    with app.transaction(form) as (tx, _):
        assert app.pool.add("close", "8", timedelta(0), transaction=tx) == AddResult.INSERTED
    eight = app.pool.get("close", "8")
    assert eight is not None and eight.state == "queued"


@every_sql_store
def test_bad_input_and_the_wrong_connection_are_refused_before_anything_is_written(app: App, tmp_path: Path) -> None:
    with app.transaction("connection") as (tx, write):
        write(1)
        with pytest.raises(ConfigurationError, match="naive"):
            app.pool.add("close", "1", __import__("datetime").datetime(2030, 1, 1), transaction=tx)
        with pytest.raises(ConfigurationError, match="an Engine has no transaction"):
            app.pool.add("close", "1", timedelta(0), transaction=app.engine)
        with pytest.raises(ConfigurationError, match="not a connection mutexcron can use"):
            app.pool.add("close", "1", timedelta(0), transaction=object())
    # Another database of the same kind.
    other = sqlalchemy.create_engine(f"sqlite:///{tmp_path}/other.db" if app.kind == "sqlite" else other_database(app))
    try:
        with other.begin() as conn, pytest.raises(ConfigurationError, match="the task would not commit with your writes"):
            app.pool.add("close", "1", timedelta(0), transaction=conn)
    finally:
        other.dispose()
    # Another kind of database.
    elsewhere = sqlalchemy.create_engine(f"sqlite:///{tmp_path}/x.db")
    if app.kind != "sqlite":
        with elsewhere.begin() as conn, pytest.raises(ConfigurationError, match="your transaction is on sqlite"):
            app.pool.add("close", "1", timedelta(0), transaction=conn)
    # Autocommit: each statement would commit on its own.
    auto = app.engine.execution_options(isolation_level="AUTOCOMMIT")
    with auto.connect() as conn, pytest.raises(ConfigurationError, match="autocommit mode with no transaction open"):
        app.pool.add("close", "1", timedelta(0), transaction=conn)
    elsewhere.dispose()
    assert app.pool.get("close", "1") is None and app.rows() == [1]


def other_database(app: App) -> str:
    name = "mysql" if app.kind == "mysql" else "postgres"  # present on every server of that kind
    return str(sqlalchemy.make_url(app.app_url).set(database=name))


def test_a_store_that_is_not_sql_says_so(tmp_path: Path) -> None:
    import sqlite3

    with TaskPool("memory://tx-refused") as pool:
        raw = sqlite3.connect(tmp_path / "x.db")
        with pytest.raises(ConfigurationError, match="needs a SQL task store"):
            pool.add("close", "1", timedelta(0), transaction=raw)
        with pytest.raises(ConfigurationError, match="needs a SQL task store"):
            pool.cancel("close", "1", transaction=raw)
        raw.close()


@every_sql_store
def test_a_committed_add_wakes_a_sleeping_worker_within_the_usual_lag(app: App) -> None:
    started: list[float] = []
    ran = threading.Event()

    def handler(task: Task) -> None:
        started.append(time.monotonic())
        ran.set()

    with running(app, Handler("wake", handler), backstop=60.0):  # only a wake-up can wake it
        time.sleep(0.5)  # asleep on the waker: nothing is due
        with app.transaction("connection") as (tx, write):
            write(1)
            app.pool.add("wake", "1", timedelta(0), transaction=tx)
            time.sleep(0.6)  # due, but not committed: no worker may see it
            assert not ran.is_set()
            committed = time.monotonic()
        assert ran.wait(10), "the committed task never woke the worker"
        lag = started[0] - committed
        usual = {"postgresql": 0.01, "sqlite": 0.025, "mysql": 0.2}[app.kind]  # a notice; the change check; the poll
        assert lag < usual + 1.0, f"woken {lag:.3f}s after the commit (the usual lag here: {usual}s)"


# -- complete ----------------------------------------------------------------------------------------
def ledger_handler(
    app: App, *, after_complete: Callable[[Task], None] | None = None, gate: threading.Event | None = None
) -> tuple[Callable[[Task], None], list[str]]:
    """A handler that writes the ledger row (the business table: id = the task's key) and completes its
    task in the same transaction. Returns (handler, outcomes: 'committed' / the exception's name)."""
    outcomes: list[str] = []

    def handler(task: Task) -> None:
        if gate is not None:
            assert gate.wait(30)
        try:
            with app.engine.begin() as conn:
                conn.execute(sqlalchemy.text(f"INSERT INTO {app.biz} (id) VALUES (:id)"), {"id": int(task.key)})
                task.complete(conn)
                if after_complete is not None:
                    after_complete(task)
        except BaseException as exc:
            outcomes.append(type(exc).__name__)
            raise
        outcomes.append("committed")

    return handler, outcomes


@contextmanager
def running(app: App, handler: Handler, **options: Any) -> Iterator[TaskWorker]:
    """A started worker of ``handler`` on the app's task store (no heartbeat: nothing renews its leases)."""
    store = SQLTaskStore(app.url)
    worker = TaskWorker(store, {handler.code: handler}, NODE, **{"backstop": 0.1, **options})
    worker.start()
    try:
        yield worker
    finally:
        worker.stop(5)
        store.close()


@every_sql_store
def test_a_handler_that_completes_in_its_transaction_commits_both_and_the_worker_records_nothing(
    app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler, outcomes = ledger_handler(app)
    calls: list[Any] = []
    with running(app, Handler("charge", handler)) as worker:
        own = worker.completions.submit
        monkeypatch.setattr(worker.completions, "submit", lambda *a: calls.append(a) or own(*a))
        app.pool.add("charge", "41", timedelta(0))
        assert wait_for(lambda: worker.stats.done == 1)
    assert outcomes == ["committed"] and app.rows() == [41] and app.pool.get("charge", "41") is None
    assert calls == [] and worker.stats.refused == 0  # the handler's transaction was the completion


@every_sql_store
def test_a_completion_whose_transaction_then_fails_is_a_failed_attempt_recorded_by_the_worker(app: App) -> None:
    def boom(task: Task) -> None:
        raise RuntimeError("after the completion")

    handler, outcomes = ledger_handler(app, after_complete=boom)
    app.pool.add("charge", "42", timedelta(0))
    with running(app, Handler("charge", handler, backoff=3600)) as worker:
        assert wait_for(lambda: worker.stats.retried == 1)
    task = app.pool.get("charge", "42")
    assert outcomes == ["RuntimeError"] and app.rows() == []  # the ledger row rolled back with the completion
    assert task is not None and task.state == "queued" and task.attempt == 1 and "after the completion" in (task.last_error or "")


@every_sql_store
def test_a_stale_attempt_completing_in_its_transaction_is_refused_and_its_writes_roll_back(app: App) -> None:
    gate = threading.Event()
    handler, outcomes = ledger_handler(app, gate=gate)
    app.pool.add("charge", "43", timedelta(0))
    # One thread, busy with the first attempt, and no claiming ahead: this worker cannot claim the task again itself.
    with running(app, Handler("charge", handler, lease=1.0), concurrency=1, claim_ahead=0) as worker:
        assert wait_for(lambda: worker.running() != {})
        time.sleep(1.6)  # the lease ran out (store clock); nobody renewed it
        [newer] = app.pool.store.claim("node-b:2:bbbb", ["charge"], 10, 30)  # another node takes it over
        gate.set()
        assert wait_for(lambda: worker.stats.refused == 1)
        time.sleep(0.3)  # the worker must record nothing more for that attempt
    task = app.pool.get("charge", "43")
    assert outcomes == ["StaleTaskError"] and app.rows() == []  # the stale attempt's insert rolled back
    assert task is not None and (task.state, task.owner, task.token) == ("running", "node-b:2:bbbb", newer.token)
    assert worker.stats.retried == worker.stats.done == worker.stats.released == 0


@every_sql_store
def test_task_complete_checks_its_connection_and_refuses_a_second_call(app: App) -> None:
    seen: list[str] = []

    def handler(task: Task) -> None:
        with app.engine.begin() as conn:
            task.complete(conn, reschedule=timedelta(hours=1))
            try:
                task.complete(conn)
            except ConfigurationError as exc:
                seen.append(str(exc))

    app.pool.add("again", "1", timedelta(0))
    with running(app, Handler("again", handler)) as worker:
        assert wait_for(lambda: worker.stats.rescheduled == 1)
    task = app.pool.get("again", "1")
    assert task is not None and task.state == "queued" and task.due > app.pool.store.now() + timedelta(minutes=59)
    assert len(seen) == 1 and "called already" in seen[0]
    with pytest.raises(
        ConfigurationError, match="not handed out by a task worker"
    ):  # a Task not handed out by a worker cannot complete
        Task(task, lambda: False).complete(None)


@every_sql_store
def test_task_complete_reschedules_with_a_new_payload_in_the_callers_transaction(app: App) -> None:
    """Issue 25 item 14 in a handler's own transaction: task.complete(conn, reschedule=Reschedule(due, payload=...))."""
    from mutexcron import Reschedule

    def handler(task: Task) -> None:
        with app.engine.begin() as conn:
            task.complete(conn, reschedule=Reschedule(timedelta(hours=1), payload={"cursor": task.payload["cursor"] + 1}))

    app.pool.add("page", "1", timedelta(0), {"cursor": 1})
    with running(app, Handler("page", handler)) as worker:
        assert wait_for(lambda: worker.stats.rescheduled == 1)
    task = app.pool.get("page", "1")
    assert task is not None and task.state == "queued" and task.payload == {"cursor": 2}


# -- a process killed before its commit --------------------------------------------------------------
KILLED = """
import sys, time
from datetime import timedelta
import sqlalchemy
from mutexcron import TaskPool
url, app_url, biz = sys.argv[1:4]
pool = TaskPool(url)
engine = sqlalchemy.create_engine(app_url)
with engine.begin() as conn:
    conn.execute(sqlalchemy.text(f"INSERT INTO {biz} (id) VALUES (1042)"))
    pool.add("close", "1042", timedelta(minutes=30), transaction=conn)
    print("written, not committed", flush=True)
    time.sleep(60)
"""


@every_sql_store
def test_a_process_killed_between_the_business_write_and_the_commit_leaves_neither(app: App, tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    proc = subprocess.Popen(
        [sys.executable, str(script), app.url, app.app_url, app.biz], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "written, not committed" in line, line + proc.stdout.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert wait_for(lambda: app.rows() == [] and app.pool.get("close", "1042") is None, timeout=20)
    with app.transaction("connection") as (tx, write):  # and nothing is left locked
        write(1042)
        assert app.pool.add("close", "1042", timedelta(minutes=30), transaction=tx) == AddResult.INSERTED
    assert app.rows() == [1042] and app.pool.get("close", "1042") is not None


@pytest.mark.sqlite
@pytest.mark.parametrize("kind", ["sqlite"])
def test_sqlite_a_fresh_pool_adds_inside_a_transaction_that_holds_the_write_lock(app: App) -> None:
    """A pool whose store opened no connection yet (a new web process) adds inside a transaction that
    already wrote: no connection of the store's own, which would wait on the caller's write lock."""
    fresh = TaskPool(app.url)
    try:
        started = time.monotonic()
        with app.transaction("connection") as (tx, write):
            write(1)
            assert fresh.add("close", "1", timedelta(minutes=30), transaction=tx) == AddResult.INSERTED
        assert time.monotonic() - started < 5 and app.pool.get("close", "1") is not None
    finally:
        fresh.close()
    missing = TaskPool(f"{app.url}_missing")  # the same file, a task table nobody created
    try:
        with app.transaction("connection") as (tx, write), pytest.raises(ConfigurationError, match="create it before"):
            write(2)
            missing.add("close", "2", timedelta(minutes=30), transaction=tx)
    finally:
        missing.close()


@every_sql_store
def test_a_run_completed_in_an_open_transaction_is_not_renewed(app: App) -> None:
    """Between ``task.complete(conn)`` and the commit, the handler's transaction holds the task's row
    (the file's write lock on SQLite): a renewal would wait on it. The heartbeat leaves that run alone."""
    completed, gate = threading.Event(), threading.Event()

    def handler(task: Task) -> None:
        with app.engine.begin() as conn:
            task.complete(conn)
            completed.set()
            assert gate.wait(30)  # the transaction stays open while the heartbeat comes round

    clock = FakeClock()
    app.pool.add("slow", "1", timedelta(0))
    with running(app, Handler("slow", handler, lease=30), clock=clock) as worker:
        assert completed.wait(15)
        clock.advance(11)  # past lease/3: its renewal is due
        renewing = threading.Thread(target=worker.renew_round)
        renewing.start()
        renewing.join(3)
        returned = not renewing.is_alive()
        gate.set()
        renewing.join(30)
        assert returned, "the renewal waited on the handler's open transaction"
        assert wait_for(lambda: worker.stats.done == 1)
    assert worker.stats.lost == 0 and app.pool.get("slow", "1") is None


@pytest.mark.parametrize("kind", backend_params("postgresql"))
def test_a_psycopg2_connection_carries_the_task_like_psycopg_3(app: App) -> None:
    """transaction= with the older driver, psycopg2: the task commits or rolls back with the caller."""
    psycopg2 = pytest.importorskip("psycopg2", reason="psycopg2-binary is in the test extra")
    dsn = sqlalchemy.make_url(app.app_url).set(drivername="postgresql").render_as_string(hide_password=False)
    raw = psycopg2.connect(dsn)
    try:
        with raw.cursor() as cur:
            cur.execute(f"INSERT INTO {app.biz} (id) VALUES (1)")
        assert app.pool.add("close", "p2-1", timedelta(minutes=30), transaction=raw) == AddResult.INSERTED
        raw.rollback()
        assert app.pool.get("close", "p2-1") is None and app.rows() == []
        with raw.cursor() as cur:
            cur.execute(f"INSERT INTO {app.biz} (id) VALUES (2)")
        app.pool.add_many([("close", "p2-2", timedelta(minutes=30))], transaction=raw)
        assert app.pool.cancel("close", "missing", transaction=raw) is False
        raw.commit()
        task = app.pool.get("close", "p2-2")
        assert app.rows() == [2] and task is not None and task.state == "queued"
        raw.autocommit = True  # no transaction open: refused, nothing written
        with pytest.raises(ConfigurationError, match="transaction"):
            app.pool.add("close", "p2-3", timedelta(minutes=30), transaction=raw)
        assert app.pool.get("close", "p2-3") is None
    finally:
        raw.close()
