"""The task-pool examples, run as a user would: examples/delayed_tasks.py under `mutexcron run`,
examples/add_tasks.py as a script, and the Django example (examples/django_shop) through its
manage.py, Django's test client and `mutexcron run orders/jobs.py`. Each on a tmp SQLite file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from mutexcron import TaskPool

pytestmark = pytest.mark.sqlite

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SHOP = EXAMPLES / "django_shop"


def env(**extra: str) -> dict[str, str]:
    """This environment without a store URL of the caller's (each test names its own), plus ``extra``."""
    base = {k: v for k, v in os.environ.items() if k not in ("MUTEXCRON_LOCK_URL", "DJANGO_SETTINGS_MODULE")}
    return {**base, "PYTHONUNBUFFERED": "1", **extra}


def wait_for(condition: Callable[[], bool], what: str, proc: subprocess.Popen[str], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if proc.poll() is not None:
            pytest.fail(f"the node exited ({proc.returncode}) before {what}:\n{proc.communicate()[0]}")
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"timed out waiting for {what}:\n{proc.communicate()[0]}")


def stop(proc: subprocess.Popen[str]) -> str:
    """SIGTERM, as a service manager stops a node: the output, after asserting a clean exit."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "SIGTERM received" in out and "stopped" in out, out
    return out


def node(jobs: str, *args: str, cwd: Path, environ: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "mutexcron", "run", jobs, "--node-id", "solo", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environ,
    )


# -- examples/delayed_tasks.py ---------------------------------------------------------------------
def test_delayed_tasks_example_runs_its_handlers_then_stops_on_sigterm(tmp_path: Path) -> None:
    url, app_db = f"sqlite:///{tmp_path}/tasks.db", tmp_path / "app.db"
    with TaskPool(url) as pool:
        now = timedelta(0)
        assert pool.add("end_promotion", "sku-123", now, payload={"pct": 20}) == "inserted"
        pool.add("send_reminder", "user-42", now, payload={"text": "your cart is waiting", "every": 3600})
        pool.add("charge_invoice", "inv-1", now, payload={"amount_cents": 1999})
        pool.add("charge_invoice", "inv-2", now, payload={"amount_cents": 500})
        # inv-2 as if a stalled node had already run it: its charge is in the ledger under the
        # task's idempotency key. The run here must not charge it again.
        inv2 = pool.get("charge_invoice", "inv-2")
        assert inv2 is not None
        with sqlite3.connect(app_db) as db:
            db.execute(
                "CREATE TABLE ledger (idempotency_key TEXT NOT NULL UNIQUE, invoice TEXT NOT NULL, "
                "amount_cents INTEGER NOT NULL, token INTEGER NOT NULL, charged_at TEXT NOT NULL)"
            )
            db.execute("INSERT INTO ledger VALUES (?, 'inv-2', 500, 99, 'earlier')", (inv2.idempotency_key,))
        db.close()

        proc = node(str(EXAMPLES / "delayed_tasks.py"), "--lock-url", url, cwd=tmp_path, environ=env(EXAMPLE_APP_DB=str(app_db)))
        try:

            def finished() -> bool:
                reminder = pool.get("send_reminder", "user-42")
                one_offs = [pool.get("end_promotion", "sku-123"), *(pool.get("charge_invoice", k) for k in ("inv-1", "inv-2"))]
                return all(t is None for t in one_offs) and reminder is not None and reminder.attempt == 0 and reminder.token > 0

            wait_for(finished, "the handlers to finish their tasks", proc)
            reminder = pool.get("send_reminder", "user-42")
            store_now = pool.store.now()
        finally:
            out = stop(proc) if proc.poll() is None else proc.communicate()[0]

    # end_promotion and charge_invoice returned None: done, deleted. send_reminder returned
    # timedelta(seconds=3600): the same task, queued an hour after the store's clock, payload kept.
    assert reminder is not None and reminder.state == "queued" and reminder.payload["every"] == 3600
    assert timedelta(minutes=59) < reminder.due - store_now <= timedelta(hours=1), (reminder.due, store_now)
    with sqlite3.connect(app_db) as db:
        assert db.execute("SELECT sku, pct FROM promotion_log").fetchall() == [("sku-123", 20)]
        assert db.execute("SELECT user_id, text FROM reminder_log").fetchall() == [("user-42", "your cart is waiting")]
        ledger = db.execute("SELECT invoice, amount_cents, token FROM ledger ORDER BY invoice").fetchall()
    db.close()
    assert ledger == [("inv-1", 1999, 1), ("inv-2", 500, 99)], ledger  # inv-2 charged once, by the earlier run
    assert "charged invoice inv-1: 1999 cents" in out
    assert "invoice inv-2 was already charged by an earlier run of this task" in out
    handled = re.search(r"runs task handlers for ([^(]*) \(", out)
    assert handled is not None and {"charge_invoice", "end_promotion", "send_reminder"} <= set(handled[1].split(", "))


# -- examples/add_tasks.py -------------------------------------------------------------------------
def run_add_tasks(tmp_path: Path, url: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "add_tasks.py"), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        env=env(MUTEXCRON_LOCK_URL=url),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_add_tasks_example_adds_updates_cancels_and_lists(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/producer.db"
    out = run_add_tasks(tmp_path, url, "--now")
    assert f"task store: {url}" in out
    for line in (
        "end_promotion/sku-123: inserted",
        "end_promotion/sku-123 again, 7 days, earliest: kept",
        "charge_invoice/inv-1001: inserted",
        "send_reminder/user-42: inserted",
        "cancel end_promotion/sku-999: True",
        "cancel end_promotion/sku-999 again: False",
        "get end_promotion/sku-123: queued",
    ):
        assert line in out, out
    with TaskPool(url) as pool:
        now = pool.store.now()
        tasks = {(t.code, t.key): t for t in pool.list()}
        assert set(tasks) == {("end_promotion", "sku-123"), ("charge_invoice", "inv-1001"), ("send_reminder", "user-42")}
        assert all(t.due <= now and t.state == "queued" for t in tasks.values())  # --now: due now
        assert tasks["charge_invoice", "inv-1001"].payload == {"amount_cents": 1999}

        # Without --now: the same tasks (same identities) replaced with their production due times.
        out = run_add_tasks(tmp_path, url)
        assert "end_promotion/sku-123: replaced" in out and "charge_invoice/inv-1001: replaced" in out, out
        now = pool.store.now()
        promo, invoice = pool.get("end_promotion", "sku-123"), pool.get("charge_invoice", "inv-1001")
        assert promo is not None and timedelta(days=3) - timedelta(minutes=1) < promo.due - now <= timedelta(days=3)
        tomorrow = (datetime.now(timezone.utc) + timedelta(days=1)).date()
        assert invoice is not None and (invoice.due.hour, invoice.due.minute) == (8, 0)
        assert invoice.due.date() in (tomorrow, tomorrow - timedelta(days=1))  # the run may straddle midnight
        assert len(pool.list()) == 3


# -- examples/django_shop --------------------------------------------------------------------------
def test_django_migration_creates_the_table_mutexcron_ddl_prints(tmp_path: Path) -> None:
    """The migration's RunSQL is `mutexcron ddl`'s task table for SQLite, statement for statement."""
    pytest.importorskip("django")
    from mutexcron.tasks.stores.sql import SQLTaskStore

    spec = importlib.util.spec_from_file_location("shop_0002", SHOP / "orders" / "migrations" / "0002_mutexcron_tasks.py")
    assert spec is not None and spec.loader is not None
    migration = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(migration)
    store = SQLTaskStore(f"sqlite:///{tmp_path}/ddl.db")
    try:
        assert [s.strip() for s in migration.MUTEXCRON_TASKS_DDL] == [s.strip() for s in store.ddl()]
    finally:
        store.close()


def manage(db: Path, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=SHOP,
        capture_output=True,
        text=True,
        timeout=60,
        env=env(SHOP_DB_PATH=str(db)),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


CLIENT = """
import json
from django.test import Client

client = Client()
seen = {}
made = client.post("/orders/", {"amount_cents": 1999}, content_type="application/json")
seen["create"] = [made.status_code, made.json()]
order = made.json()["id"]
seen["detail"] = client.get(f"/orders/{order}/").json()
paid = client.post(f"/orders/{order}/pay/")
seen["pay"] = [paid.status_code, paid.json()]
seen["after_pay"] = client.get(f"/orders/{order}/").json()
again = client.post(f"/orders/{order}/pay/")
seen["pay_again"] = again.status_code
unpaid = client.post("/orders/", {"amount_cents": 500}, content_type="application/json")
seen["unpaid"] = [unpaid.status_code, unpaid.json()]

# The recipe itself: an add in an atomic block that then fails leaves neither the order nor its
# task; an add on Django's connection outside atomic() is refused (it would commit on its own).
from datetime import timedelta
from django.db import connection, transaction
from mutexcron import ConfigurationError
from orders.models import Order
from orders.pool import CLOSE_UNPAID_ORDER, task_pool

try:
    with transaction.atomic():
        doomed = Order.objects.create(amount_cents=7)
        task_pool().add(CLOSE_UNPAID_ORDER, str(doomed.pk), timedelta(minutes=30), transaction=connection)
        raise RuntimeError("the view failed after the add")
except RuntimeError:
    pass
seen["rolled_back"] = [Order.objects.filter(pk=doomed.pk).exists(), task_pool().get(CLOSE_UNPAID_ORDER, str(doomed.pk))]
try:
    task_pool().add(CLOSE_UNPAID_ORDER, "x", timedelta(minutes=30), transaction=connection)
    seen["outside_atomic"] = "added"
except ConfigurationError as exc:
    seen["outside_atomic"] = str(exc)
print("RESULT " + json.dumps(seen))
"""


def test_django_shop_adds_cancels_and_runs_the_close_task(tmp_path: Path) -> None:
    pytest.importorskip("django")
    db = tmp_path / "shop.sqlite3"
    url = f"sqlite:///{db}"  # what shop/settings.py derives from SHOP_DB_PATH

    out = manage(db, "migrate", "--no-input")
    assert "Applying orders.0002_mutexcron_tasks... OK" in out, out
    with sqlite3.connect(db) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'index')")}
    conn.close()
    assert {"orders_order", "mutexcron_tasks", "mutexcron_tasks_run_at"} <= tables

    # The web side, through Django's test client: create an order (its close task is added, due
    # in 30 minutes), pay it (the task is cancelled), create a second one and leave it unpaid.
    out = manage(db, "shell", "-c", CLIENT)
    seen = json.loads(out.split("RESULT ", 1)[1])
    assert seen["create"] == [201, {"id": 1, "amount_cents": 1999, "status": "unpaid", "close_task": "inserted"}]
    assert seen["detail"]["close_task"]["state"] == "queued"
    assert seen["pay"] == [200, {"id": 1, "amount_cents": 1999, "status": "paid", "close_task_cancelled": True}]
    assert seen["after_pay"]["status"] == "paid" and seen["after_pay"]["close_task"] is None
    assert seen["pay_again"] == 409
    assert seen["unpaid"][0] == 201 and seen["unpaid"][1]["id"] == 2
    assert seen["rolled_back"] == [False, None]  # no order 3, no task for it
    assert "autocommit mode here" in seen["outside_atomic"] and "transaction.atomic()" in seen["outside_atomic"]

    with TaskPool(url) as pool:
        assert pool.get("close_unpaid_order", "1") is None  # cancelled by the payment
        task = pool.get("close_unpaid_order", "2")
        assert task is not None and task.state == "queued" and task.payload == {"amount_cents": 500}
        assert timedelta(minutes=29) < task.due - pool.store.now() <= timedelta(minutes=30)

        # Its payment window ends now; a node runs the app's jobs module as the README says.
        assert pool.add("close_unpaid_order", "2", timedelta(0), payload={"amount_cents": 500}) == "replaced"
        proc = node("orders/jobs.py", cwd=SHOP, environ=env(SHOP_DB_PATH=str(db), DJANGO_SETTINGS_MODULE="shop.settings"))
        try:

            def closed() -> bool:
                with sqlite3.connect(db) as conn:
                    status = conn.execute("SELECT status FROM orders_order WHERE id = 2").fetchone()
                conn.close()
                return status == ("closed",) and pool.get("close_unpaid_order", "2") is None

            wait_for(closed, "order 2 to be closed by close_unpaid_order", proc)
        finally:
            out = stop(proc) if proc.poll() is None else proc.communicate()[0]
    assert "closed unpaid order 2 (500 cents)" in out, out
    assert f"using lock store {url}" in out, out
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT id, status FROM orders_order ORDER BY id").fetchall() == [(1, "paid"), (2, "closed")]
    conn.close()
