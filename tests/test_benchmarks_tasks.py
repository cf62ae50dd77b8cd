"""Smoke test of benchmarks/tasks.py: its quick run on SQLite prints every table, so the script does not rot.

It asserts no number (the benchmark's figures depend on the machine): only that each phase ran
and produced a row (3 worker nodes, a throughput, two lag loads, a recovery, an idle figure).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "tasks.py"

pytestmark = [pytest.mark.sqlite, pytest.mark.cluster]


SHORT = ("--lag-seconds", "1.5", "--idle-seconds", "0.5", "--raw-seconds", "0.5")


def test_quick_run_on_sqlite_prints_every_table() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MUTEXCRON_")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--stores", "sqlite", *SHORT],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sections = {
        part.split("\n", 1)[0]: [line for line in part.splitlines() if line.startswith("| mutexcron, sqlite")]
        for part in proc.stdout.split("\n## ")[1:]
    }
    out = proc.stdout
    for title in ("Throughput", "Due-to-start lag", "Recovery after SIGKILL", "Idle (no due task)"):
        assert len(sections.get(title, [])) == (2 if title == "Due-to-start lag" else 1), out
    throughput = sections["Throughput"][0].split("|")
    assert throughput[2].strip() == "330"  # tasks: 300 added in batches, 30 one at a time
    assert float(throughput[3].strip()) > 0  # seconds to add the batches
    assert float(throughput[6].strip().replace(",", "")) > 0  # tasks/s
    assert throughput[11].strip() == "0"  # run twice
    for lag in sections["Due-to-start lag"]:
        started, added = (int(x.strip().replace(",", "")) for x in lag.split("|")[5].split("/"))
        assert started == added > 0  # every task added by the producers started
    recovery = sections["Recovery after SIGKILL"][0].split("|")
    assert recovery[4].strip() == "1"  # the SIGKILLed node's task was started by another node
    assert "failed" not in out and "skipped" not in out, out
