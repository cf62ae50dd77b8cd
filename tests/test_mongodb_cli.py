"""`mongodb://` through the real CLI (`run`, `status`) and the example, on mongomock.

There is no MongoDB server on these machines. These tests build the production
MongoDBLockStore from a `mongodb://` URL exactly as `mutexcron run` does, and swap in only the
client (mongomock, serialised) and the clock seam (mongomock does not know `$$NOW`): they prove
the CLI and scheduler wiring, not the server. The real-server run is in README, MongoDB tests.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mongomock")
import mongomock
from click.testing import CliRunner

from mutexcron.cli.main import main
from mutexcron.locks import lock_store_from_url
from mutexcron.locks.mongodb import MongoDBLockStore
from tests.mongomock_support import SerializedClient

pytestmark = pytest.mark.mongodb
URL = "mongodb://ops:hunter2@mongo1.invalid,mongo2.invalid/jobs?replicaSet=rs0&collection=locks"
EXAMPLE = Path(__file__).parent.parent / "examples" / "jobs.py"


@pytest.fixture
def mongomock_everywhere(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every MongoDBLockStore built from a URL uses one shared mongomock client and the real clock."""
    client = SerializedClient(mongomock.MongoClient(tz_aware=True))
    original = MongoDBLockStore.__init__

    def init(self: MongoDBLockStore, url: str, **options: Any) -> None:
        options.setdefault("client", client)
        options.setdefault("now", lambda: datetime.now(timezone.utc))
        original(self, url, **options)

    monkeypatch.setattr(MongoDBLockStore, "__init__", init)
    from mutexcron.tasks.stores.mongodb import MongoDBTaskStore

    original_tasks = MongoDBTaskStore.__init__

    def init_tasks(self: MongoDBTaskStore, url: str, **options: Any) -> None:
        options.setdefault("client", client)
        options.setdefault("now", lambda: datetime.now(timezone.utc))
        original_tasks(self, url, **options)

    monkeypatch.setattr(MongoDBTaskStore, "__init__", init_tasks)
    yield


def test_run_then_status_on_mongodb_url(mongomock_everywhere: None) -> None:
    """`mutexcron run examples/jobs.py --lock-url mongodb://...` runs the guarded job; `status` shows it."""
    runner = CliRunner()
    threading.Timer(6.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    result = runner.invoke(main, ["run", str(EXAMPLE), "--lock-url", URL, "--node-id", "mongo-node"])
    assert result.exit_code == 0, result.output
    store = lock_store_from_url(URL)
    rec = store.read("billing")
    assert rec is not None and rec.holder is None, "released at SIGTERM"
    assert rec.token == 1 and rec.attrs["cursor"] >= 100, "the example ran and handed over its attrs"
    status = runner.invoke(main, ["status", "--lock-url", URL])
    assert status.exit_code == 0, status.output
    assert "ops:***@" in status.output and "hunter2" not in status.output
    assert "billing" in status.output and "released" in status.output


def test_guarded_job_runs_once_across_two_schedulers(mongomock_everywhere: None) -> None:
    from mutexcron import MutexScheduler

    runs: list[str] = []
    scheds = []
    for node in ("a", "b"):
        sched = MutexScheduler(lock_url=URL, node_id=node)

        @sched.mutex(lock="tick", unactive_interval=2)
        @sched.interval_schedule(seconds=0.3, id="tick")
        def tick(node: str = node) -> None:
            runs.append(node)

        scheds.append(sched)
        sched.start()
    time.sleep(2)
    for sched in scheds:
        sched.shutdown()
    assert runs and len(set(runs)) == 1
