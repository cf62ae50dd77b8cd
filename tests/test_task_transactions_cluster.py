"""Exactly-once effects with real `mutexcron run` nodes: 3 per SQL store, a holder frozen past its lease.

Each node runs tests/nodes/tx_ledger_node.py: its handler inserts one ledger row per task and
completes the task in the same transaction (``task.complete(conn)``). The ledger has no unique
key. One task's first holder is SIGSTOPped mid-handler (on PostgreSQL and MariaDB inside its open
transaction, after its insert; on SQLite before its transaction, which would otherwise hold the
file's write lock and stop the whole cluster) until another node has run and committed that task,
then continued: its completion fails its fence, its insert rolls back, and every occurrence has
exactly one ledger row although one task ran twice.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy

from mutexcron import TaskPool
from tests.backends import backend_params, drop_store_tables, require_server
from tests.schedulers import wait_for

pytestmark = pytest.mark.cluster

JOBS_FILE = Path(__file__).parent / "nodes" / "tx_ledger_node.py"
DRIVERS = {"mysql": "mysql+pymysql", "postgresql": "postgresql+psycopg"}
LEASE = 2.0
TASKS = 24
STALL_KEY = "k07"


def events(workdir: Path) -> list[dict[str, Any]]:
    found = [
        json.loads(line) for path in workdir.glob("n*.jsonl") for line in path.read_text().splitlines() if line.endswith("}")
    ]
    return sorted(found, key=lambda e: e["t"])


def freeze(node: subprocess.Popen[bytes], kind: str, sqlite_file: Path) -> None:
    """SIGSTOP ``node``; on SQLite, at a moment it does not hold the file's write lock (a renewal, a
    claim in flight): a frozen writer would stop every node, which is SQLite's limit, not this test's."""
    for _ in range(100):
        node.send_signal(signal.SIGSTOP)
        if kind != "sqlite" or _write_lock_free(sqlite_file):
            return
        node.send_signal(signal.SIGCONT)
        time.sleep(0.05)
    pytest.fail("the node to freeze held the SQLite write lock at every try")


def _write_lock_free(path: Path) -> bool:
    db = sqlite3.connect(path, timeout=1.0)
    try:
        db.execute("BEGIN IMMEDIATE")
        db.rollback()
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        db.close()


@pytest.mark.parametrize("kind", backend_params("sqlite", "mysql", "postgresql"))
def test_a_task_run_twice_leaves_exactly_one_ledger_row_per_occurrence(kind: str, tmp_path: Path) -> None:
    tag = secrets.token_hex(3)
    if kind == "sqlite":
        base = app_url = f"sqlite:///{tmp_path}/app.db"
    else:
        base = require_server(kind)
        app_url = str(sqlalchemy.make_url(base).set(drivername=DRIVERS[kind]))
    url = f"{base}{'&' if '?' in base else '?'}table=mc_txl_{tag}&tasks_table=mc_txl_{tag}_tasks"
    table = f"mc_ledger_{tag}"
    engine = sqlalchemy.create_engine(app_url)
    with engine.begin() as conn:  # no unique key: only the fence keeps a second row out
        conn.execute(
            sqlalchemy.text(
                f"CREATE TABLE {table} (occurrence VARCHAR(255), task_key VARCHAR(64), token INTEGER, node VARCHAR(32))"
            )
        )
    pool = TaskPool(url)
    nodes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        env = {
            **os.environ,
            "MUTEXCRON_LOCK_URL": url,
            "TASK_LEASE": str(LEASE),
            "LEDGER_DIR": str(tmp_path),
            "LEDGER_TABLE": table,
            "LEDGER_STALL_KEY": STALL_KEY,
            "LEDGER_PAUSE_IN_TX": "0" if kind == "sqlite" else "1",
            "LEDGER_APP_URL": app_url,
        }
        for name in ("n0", "n1", "n2"):
            out = open(tmp_path / f"{name}.out", "ab")
            nodes[name] = subprocess.Popen(
                [sys.executable, "-m", "mutexcron", "run", str(JOBS_FILE), "--node-id", name, "--log-level", "info"],
                env={**env, "MUTEXCRON_NODE_ID": name}, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
            out.close()
        output = lambda name: (tmp_path / f"{name}.out").read_text(errors="replace")  # noqa: E731
        for name in nodes:
            assert wait_for(lambda n=name: "runs task handlers" in output(n), 30), output(name)
        with engine.begin() as conn:  # the task to stall first, alone, in a transaction of the application's
            pool.add("ledger", STALL_KEY, timedelta(seconds=-1), transaction=conn)
        assert wait_for(lambda: any(tmp_path.glob("stall-*")), 30), "the stalled task never started"
        [marker] = tmp_path.glob("stall-*")
        holder, first_token = marker.name.removeprefix("stall-"), int(marker.read_text())
        freeze(nodes[holder], kind, tmp_path / "app.db")  # mid-handler: no renewal either
        with engine.begin() as conn:  # the others, while the holder is frozen
            for i in range(TASKS):
                if f"k{i:02d}" != STALL_KEY:
                    pool.add("ledger", f"k{i:02d}", timedelta(seconds=-1), transaction=conn)
        try:
            newer = lambda: [e for e in events(tmp_path) if e["key"] == STALL_KEY and e["event"] == "committed"]  # noqa: E731
            assert wait_for(lambda: bool(newer()), LEASE * 3 + 20), "no other node ran the stalled task\n" + "\n".join(
                f"--- {name} (frozen: {name == holder}) ---\n{output(name)[-4000:]}" for name in nodes
            )
            assert newer()[0]["node"] != holder and newer()[0]["token"] > first_token
        finally:
            (tmp_path / "go").write_text("")
            nodes[holder].send_signal(signal.SIGCONT)
        refused = lambda: [e for e in events(tmp_path) if e["event"] == "refused"]  # noqa: E731
        assert wait_for(lambda: bool(refused()), 20), output(holder)
        assert wait_for(lambda: all(pool.get("ledger", f"k{i:02d}") is None for i in range(TASKS)), 30)
    finally:
        for node in nodes.values():
            node.send_signal(signal.SIGCONT)
            node.send_signal(signal.SIGTERM)
        for node in nodes.values():
            try:
                node.wait(30)
            except subprocess.TimeoutExpired:
                node.kill()
        pool.close()
        with engine.connect() as conn:
            rows = list(conn.execute(sqlalchemy.text(f"SELECT occurrence, task_key, token, node FROM {table}")))
        with engine.begin() as conn:
            conn.execute(sqlalchemy.text(f"DROP TABLE IF EXISTS {table}"))
        engine.dispose()
        if kind != "sqlite":
            drop_store_tables(url)

    # The stalled task ran twice (token first_token on the holder, then a newer one elsewhere)...
    starts = [e for e in events(tmp_path) if e["key"] == STALL_KEY and e["event"] == "start"]
    assert len(starts) >= 2 and {e["node"] for e in starts} >= {holder}
    # Every refused attempt is the frozen holder's (the tasks it ran when frozen lost their leases
    # too), and each of those tasks was committed by a newer attempt on another node.
    stale, committed = refused(), [e for e in events(tmp_path) if e["event"] == "committed"]
    assert {(r["node"], r["key"], r["token"]) for r in stale} >= {(holder, STALL_KEY, first_token)}
    for r in stale:
        assert r["node"] == holder and any(
            c["key"] == r["key"] and c["token"] > r["token"] and c["node"] != holder for c in committed
        )
    # ...and still left exactly one ledger row per occurrence: the stale attempt's insert rolled back.
    per_occurrence = Counter(row[0] for row in rows)
    assert len(per_occurrence) == TASKS and set(per_occurrence.values()) == {1}, per_occurrence
    [stalled] = [row for row in rows if row[1] == STALL_KEY]
    assert stalled[3] != holder and stalled[2] > first_token
    assert "completion refused in the handler's transaction" in (tmp_path / f"{holder}.out").read_text(errors="replace")
