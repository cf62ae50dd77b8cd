"""Smoke test of benchmarks/task_transactions.py: its quick run on SQLite prints both tables, so the script does not rot.

It asserts no timing (the figures depend on the machine): only that every variant ran and was printed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "task_transactions.py"

pytestmark = pytest.mark.sqlite


def test_quick_run_on_sqlite_prints_every_variant() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MUTEXCRON_")}
    command = [sys.executable, str(SCRIPT), "--quick", "--stores", "sqlite"]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| sqlite |")]
    variants = {row[1].strip(): row for row in rows if len(row) == 6}
    assert len(variants) == 8, proc.stdout
    assert all(int(row[2]) == 20 for row in variants.values())  # every variant timed 20 times
    [summary] = [row for row in rows if len(row) == 5]
    assert summary[3].strip().endswith("x"), proc.stdout
