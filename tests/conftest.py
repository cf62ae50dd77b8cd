"""Fixtures every test module shares: an isolated store per backend, and the servers tests start.

The CI rule lives in :func:`tests.backends.require_server`, which every server fixture goes
through: a server that is not reachable skips the test with the reason, except under ``CI=true``,
where it fails the run (MongoDB excepted: no server can be installed on CI).

``tests`` is a package on purpose: the subprocess nodes of the cluster tests import test modules
(``python -m tests.workers``), and the package prefix keeps helper names such as ``backends`` apart
from the library's own ``mutexcron.backends``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import leaks
from tests.backends import StoreCtx, open_backend

#: The suite's nodes wait at most 3 s for a successor when they stop: every test cluster stops all
#: its nodes at once, and each would wait out the default 20 s (kept for a gunicorn reload's new
#: workers). The reload tests build their nodes' environment without MUTEXCRON_ variables, so they
#: run the default, as do the tests that check it.
os.environ.setdefault("MUTEXCRON_HAND_OVER_WAIT", "3")

_before_session: set[str] | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    global _before_session
    if leaks.enabled() and not os.environ.get("PYTEST_XDIST_WORKER"):  # once, in the controller
        _before_session = leaks.snapshot()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n 2 --dist loadgroup``), the multi-process tests (marker ``cluster``:
    nodes, drills, browsers) run one at a time on one worker, so their timed steps never compete
    with each other for the machine's cores, while the other worker runs the rest."""
    for item in items:
        if item.get_closest_marker("cluster") is not None:
            item.add_marker(pytest.mark.xdist_group("cluster"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under CI: fail the run if the tests left tables or Redis namespaces behind (tests/leaks.py)."""
    if _before_session is None:
        return
    left = sorted(leaks.snapshot() - _before_session)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"the tests left {len(left)} table(s) or namespace(s) behind: {', '.join(left)}"
        if reporter is not None:
            reporter.write_line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def ctx(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StoreCtx]:
    """An isolated store on backend ``kind`` (a table, namespace or collection of its own, dropped
    afterwards). ``redis-cluster`` starts the session's cluster on first use; ``mysql8`` runs the
    MySQL 8 code path (no RETURNING) on the MariaDB server."""
    from tests import workers

    cluster_url = request.getfixturevalue("redis_cluster").namespaced_url if kind == "redis-cluster" else None
    with open_backend("mysql" if kind == "mysql8" else kind, tmp_path, cluster_url) as opened:
        if kind == "mysql8":
            url = opened.url or ""
            opened.kind, opened.factory = kind, lambda: workers.MySQL8LockStore(url)
        yield opened


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[object]:
    """The session's 3-primary Redis Cluster (started on first use, killed at the end)."""
    from tests.redis_servers import shared_cluster

    with shared_cluster() as cluster:
        yield cluster


@pytest.fixture
def private_redis() -> Iterator[object]:
    """A private, unpersisted redis-server on a free port, killed afterwards."""
    from tests.redis_servers import REDIS_SERVER, PrivateRedis

    if not os.path.exists(REDIS_SERVER):
        pytest.skip("redis-server is not installed")
    # A short directory: unix socket paths are limited to ~100 bytes.
    workdir = Path(tempfile.mkdtemp(prefix="mc-redis-"))
    server = PrivateRedis(workdir)
    try:
        server.start()
        yield server
    finally:
        server.kill()
        shutil.rmtree(workdir, ignore_errors=True)
