"""Smoke test of benchmarks/scale.py: its quick run on SQLite prints a plain and a guarded row, so the script does not rot.

It asserts no timing (the figures depend on the machine): only that every fire time ran once
across the guarded nodes, and that the batched hand-offs were measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "scale.py"

pytestmark = [pytest.mark.sqlite, pytest.mark.cluster]


def test_quick_run_on_sqlite_runs_every_fire_time_once_and_measures_the_hand_offs() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MUTEXCRON_")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    (row_set,) = doc["row_sets"]
    assert row_set["jobs"] == 10 and row_set["plain"] is not None, row_set["notes"]
    (guarded,) = row_set["guarded"]
    assert guarded["kind"] == "sqlite"
    assert guarded["expected"] > 0 and guarded["missed"] == 0 and guarded["duplicated"] == 0, guarded
    assert guarded["handoffs_per_call"] is not None and guarded["handoffs_per_call"] >= 1, guarded
    assert 0 <= guarded["handoff_wait_p50"] <= guarded["handoff_wait_max"], guarded
