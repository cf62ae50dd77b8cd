"""What the suite leaves on the shared servers: tables in the test databases, Redis namespaces.

``tests/conftest.py`` takes a snapshot when the session starts and compares at its end; under
``CI=true`` (or ``MUTEXCRON_TEST_LEAK_CHECK=1``) anything new fails the run, naming it. Every test
drops what it creates (``tests.backends.cleanup_sql``, ``cleanup_redis``...), so the list is empty.
Off CI the check stays off: other suites may share the servers at the same moment.
"""

from __future__ import annotations

import os

from tests.backends import _reachable, server_url


def enabled() -> bool:
    return os.environ.get("CI", "").lower() == "true" or os.environ.get("MUTEXCRON_TEST_LEAK_CHECK") == "1"


def snapshot() -> set[str]:
    """``kind:name`` of every table in the SQL test databases and every mutexcron namespace in Redis."""
    found: set[str] = set()
    for kind in ("mysql", "postgresql"):
        url = server_url(kind)
        if url and _reachable(url):
            found |= {f"{kind}:{name}" for name in _tables(url)}
    url = server_url("redis")
    if url and _reachable(url):
        found |= {f"redis:{name}" for name in _namespaces(url)}
    return found


def _tables(url: str) -> list[str]:
    import sqlalchemy

    from mutexcron.locks.sql import SQLLockStore

    store = SQLLockStore(url)
    try:
        with store.engine.connect() as conn:
            return list(sqlalchemy.inspect(conn).get_table_names())
    finally:
        store.close()


def _namespaces(url: str) -> set[str]:
    import redis

    client = redis.Redis.from_url(url)
    try:
        # keys are mutexcron:{namespace}:...
        return {key.decode(errors="replace").split(":")[1] for key in client.scan_iter("mutexcron:*", count=1000)}
    finally:
        client.close()
