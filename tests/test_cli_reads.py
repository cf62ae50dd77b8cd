"""Read-only commands create nothing, on every store: `tasks list`, `tasks get`, `history`,
`status`, `jobs list` and every dashboard page on a store no node has used leave no file, table,
key or collection behind."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy
from click.testing import CliRunner

from mutexcron.cli.main import main
from tests.backends import backend_params, drop_store_tables, require_server

JOBS = """
from mutexcron import MutexScheduler
sched = MutexScheduler()

@sched.mutex(lock="billing")
@sched.interval_schedule(minutes=5)
def close_invoices():
    pass
"""

READS = (
    ["tasks", "list"],
    ["tasks", "list", "--code", "email", "--json"],
    ["tasks", "get", "email", "k1"],
    ["history"],
    ["history", "billing"],
    ["status"],
)


def _sql_tables(url: str, prefix: str) -> set[str]:
    from mutexcron.tasks.stores.sql import SQLTaskStore

    store = SQLTaskStore(url)  # an engine with the store's driver; connecting creates nothing
    try:
        return {n for n in sqlalchemy.inspect(store.backend.engine).get_table_names() if n.startswith(prefix)}
    finally:
        store.close()


def _sql(kind: str) -> tuple[str, Callable[[], set[str]], Callable[[], None]]:
    prefix = f"rd{os.getpid()}{secrets.token_hex(2)}"
    url = f"{require_server(kind)}?table={prefix}_locks&tasks_table={prefix}_tasks"
    return url, lambda: _sql_tables(url, prefix), lambda: drop_store_tables(url)


def _redis() -> tuple[str, Callable[[], set[str]], Callable[[], None]]:
    import redis

    namespace = f"rd-{secrets.token_hex(3)}"
    base = require_server("redis")
    client = redis.Redis.from_url(base)

    def keys() -> set[str]:
        return {k.decode() for k in client.scan_iter(match=f"{namespace}*")}

    def drop() -> None:
        for key in keys():
            client.delete(key)
        client.close()

    return f"{base}?namespace={namespace}", keys, drop


def _mongodb(monkeypatch: pytest.MonkeyPatch) -> tuple[str, Callable[[], set[str]], Callable[[], None]]:
    mongomock = pytest.importorskip("mongomock")
    from mutexcron.locks.mongodb import MongoDBLockStore
    from mutexcron.tasks.stores.mongodb import MongoDBTaskStore
    from tests.mongomock_support import SerializedClient

    client = SerializedClient(mongomock.MongoClient(tz_aware=True))
    for cls in (MongoDBLockStore, MongoDBTaskStore):
        original = cls.__init__

        def init(self: Any, url: str, _original: Any = original, **options: Any) -> None:
            options.setdefault("client", client)
            options.setdefault("now", lambda: datetime.now(timezone.utc))
            _original(self, url, **options)

        monkeypatch.setattr(cls, "__init__", init)
    url = "mongodb://ops:hunter2@mongo1.invalid/jobs?collection=rd_locks"
    return url, lambda: set(client["jobs"].list_collection_names()), lambda: None


@pytest.fixture(params=backend_params("sqlite", "mysql", "postgresql", "redis", "mongodb"))
def unused(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, Callable[[], set[str]]]]:
    """A store URL no node has used, and what it holds (files, tables, keys or collections)."""
    monkeypatch.chdir(tmp_path)
    kind = request.param
    if kind == "sqlite":
        url, drop = f"sqlite:///{tmp_path}/reads.db", lambda: None
        made = lambda: {p.name for p in tmp_path.iterdir()} - {"jobs.py"}  # noqa: E731
    elif kind == "redis":
        url, made, drop = _redis()
    elif kind == "mongodb":
        url, made, drop = _mongodb(monkeypatch)
    else:
        url, made, drop = _sql(kind)
    try:
        yield url, made
    finally:
        drop()


def test_no_read_only_command_creates_anything(unused: tuple[str, Callable[[], set[str]]], tmp_path: Path) -> None:
    url, made = unused
    jobs = tmp_path / "jobs.py"
    jobs.write_text(JOBS)
    runner = CliRunner()
    for args in (*READS, ["jobs", "list", str(jobs)], ["jobs", "list", str(jobs), "--json"]):
        result = runner.invoke(main, [*args, "--lock-url", url])
        assert result.exit_code in (0, 1), (args, result.output)
        assert "Traceback" not in result.output, (args, result.output)
        assert made() == set(), f"{args} created {made()}"


def test_tasks_list_in_an_empty_directory_creates_no_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default store is ./mutexcron.db: a list says there is none instead of creating it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MUTEXCRON_LOCK_URL", raising=False)
    result = CliRunner().invoke(main, ["tasks", "list"])
    assert result.exit_code == 1, result.output
    assert "no such file" in result.output and "creates nothing" in result.output
    assert list(tmp_path.iterdir()) == []


def test_no_dashboard_page_creates_anything(unused: tuple[str, Callable[[], set[str]]], tmp_path: Path) -> None:
    pytest.importorskip("mutexcron.dashboard")
    from mutexcron.dashboard import create_app
    from tests.test_dashboard import PAGES, call

    url, made = unused
    jobs = tmp_path / "jobs.py"
    jobs.write_text(JOBS)
    app = create_app(url, jobs=str(jobs))
    try:
        for path in PAGES:
            status, _headers, body = call(app, path)
            assert status == 200, (path, body)
            assert made() == set(), f"{path} created {made()}"
    finally:
        app.close()
