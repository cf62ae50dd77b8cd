"""A `mutexcron run` jobs file for the exactly-once ledger test (tests/test_task_transactions_cluster.py).

The handler of ``ledger`` writes one row per task into the application's ledger table and ends
its task with ``task.complete(conn)`` in the same transaction. The ledger has no unique key: only
the completion's fence keeps a second attempt's row out. The task ``$LEDGER_STALL_KEY`` stalls on
the first attempt that starts (inside its transaction after the insert when ``$LEDGER_PAUSE_IN_TX`` is 1,
before it otherwise) until the file ``go`` appears in ``$LEDGER_DIR``, after writing
``stall-<node>`` there: the test SIGSTOPs this node past its lease meanwhile. Each committed or
refused attempt is a JSON line in ``$LEDGER_DIR/<node>.jsonl``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import sqlalchemy

from mutexcron import MutexScheduler, StaleTaskError
from mutexcron.tasks.handlers import Task

sched = MutexScheduler()
NODE = os.environ["MUTEXCRON_NODE_ID"]
DIR = Path(os.environ["LEDGER_DIR"])
TABLE = os.environ["LEDGER_TABLE"]
STALL_KEY = os.environ["LEDGER_STALL_KEY"]
PAUSE_IN_TX = os.environ.get("LEDGER_PAUSE_IN_TX") == "1"
APP_URL = os.environ["LEDGER_APP_URL"]
engine = sqlalchemy.create_engine(APP_URL, connect_args={"timeout": 30} if APP_URL.startswith("sqlite") else {})
LOG = open(DIR / f"{NODE}.jsonl", "a", buffering=1)
INSERT = sqlalchemy.text(f"INSERT INTO {TABLE} (occurrence, task_key, token, node) VALUES (:occurrence, :key, :token, :node)")


def record(event: str, task: Task) -> None:
    LOG.write(json.dumps({"event": event, "node": NODE, "key": task.key, "token": task.token, "t": time.time()}) + "\n")


def stall(task: Task) -> None:
    if task.key != STALL_KEY:
        return
    try:  # the first attempt to start stalls: not ``task.attempt == 1``, which a node frozen before its
        (DIR / "stalled").open("x").close()  # batched started mark was written leaves at 1 for the next
    except FileExistsError:
        return
    (DIR / f"stall-{NODE}").write_text(str(task.token))
    while not (DIR / "go").exists():  # the test SIGSTOPs this process here, past the lease
        time.sleep(0.02)


@sched.tasks.handler("ledger", lease=float(os.environ.get("TASK_LEASE", "2")), max_attempts=10, backoff=0.2)
def ledger(task: Task) -> None:
    record("start", task)
    if not PAUSE_IN_TX:
        stall(task)
    try:
        with engine.begin() as conn:
            conn.execute(INSERT, {"occurrence": task.idempotency_key, "key": task.key, "token": task.token, "node": NODE})
            if PAUSE_IN_TX:
                stall(task)
            task.complete(conn)  # fenced: a stale attempt raises here, and its insert rolls back
    except StaleTaskError:
        record("refused", task)
        raise
    record("committed", task)
