"""Nodes starting together on a fresh database all come up (issue #32, B7).

APScheduler's ``SQLAlchemyJobStore.start()`` checks for its table, then creates it: of nodes
starting at the same moment, the loser of that race died (``DuplicateTable: relation ... already
exists`` on PostgreSQL). The table (and its change counter) are now created race-free.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

import pytest
import sqlalchemy
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore

from mutexcron import MutexScheduler
from mutexcron.locks.memory import MemoryLockStore
from tests.backends import backend_params, require_server

NODES = 6
ROUNDS = 4


def _url(kind: str) -> str:
    rest = require_server(kind).split("://", 1)[1]
    return f"mysql+pymysql://{rest}" if kind == "mysql" else f"postgresql+psycopg://{rest}"


@pytest.mark.parametrize("kind", backend_params("postgresql", "mysql"))
def test_nodes_starting_together_on_a_fresh_database_all_come_up(kind: str) -> None:
    url = _url(kind)
    engine = sqlalchemy.create_engine(url)
    failures: list[str] = []
    try:
        for _ in range(ROUNDS):
            table = f"aps_first_{secrets.token_hex(4)}"
            barrier = threading.Barrier(NODES)
            nodes: list[Any] = []

            def start_node() -> None:
                sched = MutexScheduler(jobstores={"default": SQLAlchemyJobStore(url=url, tablename=table)},
                                       lock_store=MemoryLockStore("memory://first-start"), triggers=False)  # fmt: skip
                nodes.append(sched)
                barrier.wait()
                try:
                    sched.start(paused=True)
                except Exception as exc:
                    failures.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")

            threads = [threading.Thread(target=start_node) for _ in range(NODES)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            for sched in nodes:
                if sched.running:
                    sched.shutdown(wait=False)
            with engine.begin() as conn:
                conn.execute(sqlalchemy.text(f"DROP TABLE IF EXISTS {table}"))
                conn.execute(sqlalchemy.text(f"DROP TABLE IF EXISTS {table}_changes"))
    finally:
        engine.dispose()
    assert not failures, failures
