"""Cluster behaviour with real processes: three `mutexcron run` nodes on one store.

One drill per store (here MariaDB and Redis; SQLite and PostgreSQL through the CLI in
tests/test_drill.py) plays SIGKILL, SIGSTOP/SIGCONT and SIGTERM of the holder and checks that
(a) a standby runs within unactive_interval + 1 s of the kill, (b) the frozen ex-holder never runs
a fire time another node ran and the attrs counter never repeats or goes back, (c) after SIGTERM
the next tick runs on a standby, and (d) no tick ever runs on two nodes.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator

import pytest

from mutexcron.drill import run_drill
from tests.backends import backend_params, cleanup_redis, cleanup_sql, require_server, sql_url

UNACTIVE_INTERVAL = 2.0

pytestmark = pytest.mark.cluster


@pytest.fixture
def cluster_url(kind: str, tmp_path) -> Iterator[str]:
    """An isolated store URL for one cluster run; its table or namespace is dropped afterwards."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path}/cluster.db"
        return
    base = require_server(kind)
    sep = "&" if "?" in base else "?"
    if kind == "redis":
        url = f"{base}{sep}namespace=cluster-{secrets.token_hex(3)}"
        yield url
        cleanup_redis(url)
    else:
        url = sql_url(base, "mc_cluster")
        yield url
        cleanup_sql(url)


# SQLite and PostgreSQL: tests/test_drill.py plays the same drill through `mutexcron drill`, with
# the same checks (its verdict holds them), so each store's drill runs once per suite.
@pytest.mark.parametrize("kind", backend_params("mysql", "redis"))
def test_failover_freeze_and_graceful_stop(kind: str, cluster_url: str) -> None:
    url = cluster_url
    progress: list[str] = []
    report = run_drill(url, nodes=3, unactive_interval=UNACTIVE_INTERVAL, duration=20, progress=progress.append)
    summary = json.dumps(report.to_json(), indent=1)
    print(f"\n[{kind}] " + summary)  # visible with -s; the closing note quotes these figures
    if os.environ.get("MUTEXCRON_CLUSTER_REPORT"):
        with open(os.environ["MUTEXCRON_CLUSTER_REPORT"], "a") as fh:
            fh.write(json.dumps({"kind": kind, **report.to_json()}) + "\n")
    assert not report.duplicated, f"(d) fire times run on two nodes: {report.duplicated}\n{summary}"
    assert report.attrs_repeats == 0, f"(b) attrs counter repeated or went back\n{summary}"
    assert report.gaps["kill"] is not None and report.gaps["kill"] <= UNACTIVE_INTERVAL + 1.0, f"(a)\n{summary}"
    assert report.gaps["freeze"] is not None and report.gaps["freeze"] <= UNACTIVE_INTERVAL + 1.0, summary
    assert report.gaps["term"] is not None and report.gaps["term"] <= 1.5, f"(c)\n{summary}"
    assert report.passed, summary
