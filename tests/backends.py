"""The backends the contract suite runs on, and how to open an isolated store on each.

Each backend gets a fresh namespace per test (a table, a key namespace or a collection) and
cleans it up afterwards. Real servers come from ``MUTEXCRON_TEST_<KIND>_URL`` or the local
defaults below. A missing server skips the test with the reason, except under ``CI=true``,
where it fails the run (MongoDB is the one exception: no server can be installed on CI).
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from mutexcron.locks import LockStore, lock_store_from_url

DEFAULT_URLS = {
    "mysql": "mysql://root@127.0.0.1:3306/test",
    "postgresql": "postgresql://postgres@127.0.0.1:5432/test",
    "redis": "redis://127.0.0.1:6379/0",
}


def server_url(kind: str) -> str | None:
    return os.environ.get(f"MUTEXCRON_TEST_{kind.upper()}_URL") or DEFAULT_URLS.get(kind)


def _reachable(url: str) -> bool:
    if "+srv://" in url:  # hosts come from DNS: let the driver find them
        return True
    parts = urlsplit(url)
    hosts = (parts.netloc.rpartition("@")[2] or "127.0.0.1").split(",")
    for hostport in hosts:
        host, _, port = hostport.partition(":")
        try:
            with socket.create_connection((host or "127.0.0.1", int(port or 0) or 27017), timeout=1.0):
                return True
        except OSError:
            continue
    return False


def require_server(kind: str) -> str:
    """The server URL for ``kind``, or skip (fail under CI=true) with a visible reason."""
    url = server_url(kind)
    if kind == "mongodb" and not url:
        pytest.skip("no MongoDB server here: set MUTEXCRON_TEST_MONGODB_URL to run against one (docs/testing.md)")
    assert url is not None
    if not _reachable(url):
        reason = f"{kind} server not reachable at {urlsplit(url).netloc.rpartition('@')[2]}"
        if os.environ.get("CI", "").lower() == "true" and kind != "mongodb":
            pytest.fail(f"{reason} (CI=true: a missing server fails the run; .ci/run starts it)")
        pytest.skip(reason)
    return url


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


@dataclass
class StoreCtx:
    """An isolated store on one backend; ``make()`` opens another client on the same data."""

    kind: str
    url: str | None
    factory: Callable[[], LockStore]
    clock: FakeClock | None = None
    opened: list[LockStore] = field(default_factory=list)

    def make(self) -> LockStore:
        store = self.factory()
        self.opened.append(store)
        return store

    def wait_stale(self, ttl: float) -> None:
        """Let a lease of ``ttl`` seconds go stale: move the fake clock, or sleep on a real server."""
        if self.clock is not None:
            self.clock.advance(ttl * 1.5 + 0.01)
        else:
            time.sleep(ttl * 1.5 + 0.05)

    @property
    def in_process(self) -> bool:
        return self.url is None


def sql_url(base: str, prefix: str) -> str:
    """``base`` with a lock table and a task table of this test's own (``<prefix>_<tag>``): a
    scheduler's task worker (``mutexcron trigger``) would otherwise create the shared default."""
    table = f"{prefix}_{secrets.token_hex(4)}"
    return f"{base}{'&' if '?' in base else '?'}table={table}&tasks_table={table}_tasks"


def sql_tables(url: str) -> list[str]:
    """Every table mutexcron creates for a SQL URL: the lock table, its ``_nodes`` presence table, its ``_floor`` token floor,
    its ``_feed`` event feed and, when the URL names one (``?tasks_table=``), the task table (the default one is shared)."""
    from mutexcron.backends.sql import DEFAULT_TABLE
    from mutexcron.urls import pop_query

    _, options = pop_query(url, "table", "tasks_table")
    table = options.get("table", DEFAULT_TABLE)
    tasks = [options["tasks_table"]] if "tasks_table" in options else []
    return [table, f"{table}_nodes", f"{table}_floor", f"{table}_feed", *tasks]


def cleanup_sql(url: str) -> None:
    """Drop every table of :func:`sql_tables`."""
    from mutexcron.locks.sql import SQLLockStore

    store = SQLLockStore(url)
    try:
        with store.engine.connect() as conn:
            for table in sql_tables(url):
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
            conn.commit()
    finally:
        store.close()


def drop_tasks_table(url: str) -> None:
    """Drop the task table of a SQL URL (``?tasks_table=`` or the default one)."""
    from mutexcron.tasks.stores.sql import SQLTaskStore

    store = SQLTaskStore(url)
    try:
        with store.backend.engine.connect() as conn:
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {store.table}")
            conn.commit()
    finally:
        store.close()


def drop_store_tables(url: str) -> None:
    """Drop every table of a SQL URL: the lock table (``?table=``), its ``_nodes``, ``_floor``,
    ``_feed`` tables and the task table."""
    from mutexcron.tasks.stores.sql import SQLTaskStore

    store = SQLTaskStore(url)
    try:
        with store.backend.engine.connect() as conn:
            locks = store.backend.table
            for name in (locks, f"{locks}_nodes", f"{locks}_floor", f"{locks}_feed", store.table):
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
            conn.commit()
    finally:
        store.close()


def cleanup_redis(url: str) -> None:
    from mutexcron.locks.redis import RedisLockStore

    store = RedisLockStore(url)
    try:
        store.destroy_namespace()
    finally:
        store.close()


def cleanup_redis_until_quiet(url: str, quiet: float = 1.0, bound: float = 10.0) -> None:
    """:func:`cleanup_redis`, again until the namespace stays empty for ``quiet`` seconds (a writer
    that outlived its test may still land a key), at most ``bound`` seconds."""
    from mutexcron.locks.redis import RedisLockStore

    deadline = time.monotonic() + bound
    store = RedisLockStore(url)
    try:
        while True:
            store.destroy_namespace()
            time.sleep(quiet)
            if not store.destroy_namespace() or time.monotonic() > deadline:
                return
    finally:
        store.close()


def _mongodb_cleanup(url: str) -> None:
    from mutexcron.locks.mongodb import MongoDBLockStore

    store = MongoDBLockStore(url)
    try:
        store.collection.drop()
        store.backend.collection(f"{store.backend.collection_name}_feed").drop()  # the event feed's
    finally:
        store.close()


@contextmanager
def open_backend(
    kind: str, tmp_path: Path, redis_cluster_url: Callable[[str], str] | None = None
) -> Iterator[StoreCtx]:
    """Yield a StoreCtx for ``kind``, isolated for this test, and clean up afterwards.

    ``redis_cluster_url(prefix)``, for ``redis-cluster`` only, gives a namespaced URL on the session's
    cluster (``tests/test_redis_cluster.py``), so that cluster is started only when that kind runs.
    """
    tag = secrets.token_hex(4)
    cleanup: Callable[[], Any] | None = None
    if kind == "memory":
        clock = FakeClock()
        from mutexcron.locks.memory import MemoryLockStore

        ctx = StoreCtx(kind, None, lambda: MemoryLockStore(f"memory://test-{tag}", clock=clock), clock=clock)
    elif kind == "mongomock":
        pytest.importorskip("mongomock")
        from tests.mongomock_support import open_mongomock

        ctx_factory, clock = open_mongomock(tag)
        ctx = StoreCtx(kind, None, ctx_factory, clock=clock)
    elif kind == "sqlite":
        url = f"sqlite:///{tmp_path}/locks-{tag}.db"
        ctx = StoreCtx(kind, url, lambda: lock_store_from_url(url))
    elif kind in ("mysql", "postgresql"):
        base = require_server(kind)
        url = f"{base}{'&' if '?' in base else '?'}table=mc_test_{tag}&tasks_table=mc_test_{tag}_tasks"
        ctx = StoreCtx(kind, url, lambda: lock_store_from_url(url))
        cleanup = lambda: cleanup_sql(url)  # noqa: E731
    elif kind == "redis":
        base = require_server(kind)
        url = f"{base}{'&' if '?' in base else '?'}namespace=test-{tag}"
        ctx = StoreCtx(kind, url, lambda: lock_store_from_url(url))
        cleanup = lambda: cleanup_redis(url)  # noqa: E731
    elif kind == "redis-cluster":
        if redis_cluster_url is None:  # pragma: no cover - a test that forgot the cluster fixture
            raise ValueError("open_backend('redis-cluster') needs redis_cluster_url")
        url = redis_cluster_url(f"test-{tag}")
        ctx = StoreCtx(kind, url, lambda: lock_store_from_url(url))
        cleanup = lambda: cleanup_redis(url)  # noqa: E731
    elif kind == "mongodb":
        base = require_server(kind)
        url = f"{base}{'&' if '?' in base else '?'}collection=mc_test_{tag}"
        ctx = StoreCtx(kind, url, lambda: lock_store_from_url(url))
        cleanup = lambda: _mongodb_cleanup(url)  # noqa: E731
    else:  # pragma: no cover - a typo in a test
        raise ValueError(kind)
    try:
        yield ctx
    finally:
        for store in ctx.opened:
            try:
                store.close()
            except Exception:
                pass
        if cleanup is not None:
            cleanup()


def backend_params(*kinds: str) -> list[Any]:
    """``pytest.param(kind, marks=pytest.mark.<kind>, id=kind)`` for each kind."""
    marks = {"mongomock": ("mongodb",), "redis-cluster": ("redis", "cluster")}  # the cluster runs 3 servers
    return [pytest.param(k, marks=[getattr(pytest.mark, m) for m in marks.get(k, (k,))], id=k) for k in kinds]


#: Set to 1 to run the long real-node tests on every store they name, not only on the stores the
#: README's test command runs them on (a cap on its length; see docs/testing.md).
FULL_MATRIX_ENV = "MUTEXCRON_TEST_FULL_MATRIX"
FULL_MATRIX_ONLY = pytest.mark.skipif(
    os.environ.get(FULL_MATRIX_ENV) != "1", reason=f"a long real-node test: {FULL_MATRIX_ENV}=1 runs it on this store too"
)


def backend_params_full_matrix(always: tuple[str, ...], more: tuple[str, ...]) -> list[Any]:
    """:func:`backend_params` of ``always``, and of ``more`` skipped unless ``$MUTEXCRON_TEST_FULL_MATRIX=1``:
    a long real-node test whose behaviour does not depend on the store beyond ``always``."""
    extra = [pytest.param(*p.values, marks=[*p.marks, FULL_MATRIX_ONLY], id=p.id) for p in backend_params(*more)]
    return [*backend_params(*always), *extra]


ALL_BACKENDS = ("memory", "sqlite", "mysql", "postgresql", "redis", "mongomock", "mongodb")
SERVER_BACKENDS = ("sqlite", "mysql", "postgresql", "redis")
