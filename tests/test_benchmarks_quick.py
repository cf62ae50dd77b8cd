"""Smoke test of benchmarks/tasks.py's peer comparison: its quick run prints the table, so it does not rot.

It asserts no rate (the figures depend on the machine): only that mutexcron on PostgreSQL drained
every task and started every light-load task, once each, and that PgQueuer got its row with a
ratio when it is installed (a benchmark-only dependency: ``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "tasks.py"

pytestmark = [pytest.mark.postgresql, pytest.mark.cluster]

QUICK = ("--quick", "--stores", "none", "--peer", "pgqueuer", "--tasks", "200")
SHORT = ("--lag-seconds", "1", "--due-min", "0.3", "--due-max", "0.8")


def test_quick_peer_comparison_prints_the_table() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MUTEXCRON_")}
    if url := os.environ.get("MUTEXCRON_TEST_POSTGRESQL_URL"):
        env["MUTEXCRON_TEST_POSTGRESQL_URL"] = url
    command = [sys.executable, str(SCRIPT), *QUICK, *SHORT]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "## Peers on the same PostgreSQL" in out, out
    rows = {line.split("|")[1].strip().split(",")[0]: line.split("|") for line in out.splitlines() if line.startswith("| ")}
    mutexcron = rows["mutexcron"]
    assert float(mutexcron[2].strip().replace(",", "")) > 0  # drain tasks/s
    assert float(mutexcron[5].strip()) > 0  # seconds to add the backlog with add_many
    assert mutexcron[8].strip() == "0"  # run twice
    p50, p99 = (float(x.strip().replace(",", "")) for x in mutexcron[7].split("/"))
    assert 0 <= p50 <= p99  # every light-load task started (a missing one is a note, checked below)
    assert "_mutexcron" not in out, out  # no failure note
    if importlib.util.find_spec("pgqueuer") is not None:
        pgqueuer = next(v for k, v in rows.items() if k.startswith("PgQueuer"))
        assert pgqueuer[4].strip().endswith("x"), out  # mutexcron / PgQueuer, same round
        assert "_PgQueuer" not in out, out
