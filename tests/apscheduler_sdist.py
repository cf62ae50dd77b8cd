"""APScheduler's own tests, from its source distribution, downloaded with pip at test time (never
committed): :func:`apscheduler_sdist` fetches and unpacks it, :func:`run_apscheduler_tests` runs one
of its test files in a subprocess (with plugins of ours) and returns each test's outcome.

Without network the caller's test skips visibly, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

#: The release whose tests are run (the 3.x branch has no later change to them).
APSCHEDULER_TESTS = "3.11.2"
ROOT = Path(__file__).resolve().parent.parent
#: Our pytest plugins for APScheduler's tests (``-p <module>``), importable from here.
PLUGINS = ROOT / "tests" / "dropin"


def apscheduler_sdist(where: Path, version: str = APSCHEDULER_TESTS, package: str = "APScheduler") -> Path:
    """Download and unpack ``package==version``'s source distribution under ``where``; its
    directory (with ``tests/``). Skips (fails under ``CI=true``) if pip cannot."""
    spec = f"{package}=={version}"
    download = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet", spec, "-d", str(where)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    archives = sorted(where.glob("*.tar.gz"))
    if download.returncode != 0 or not archives:
        reason = f"cannot download the {spec} source distribution: {download.stderr.strip()[-300:]}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{reason} (CI=true: {package}'s own tests must run)")
        pytest.skip(reason)
    with tarfile.open(archives[0]) as archive:
        archive.extractall(where, filter="data")
    return next(p for p in where.iterdir() if p.is_dir())


def run_apscheduler_tests(
    sdist: Path, test_file: str, report: Path, *pytest_args: str, env: dict[str, str] | None = None
) -> dict[str, str]:
    """Run ``test_file`` of the unpacked source distribution with ``pytest_args`` (``-p plugin``...)
    in a subprocess; ``{"<class>::<test id>": "passed" | "failed" | "error" | "skipped"}``."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(PLUGINS)]), **(env or {})}
    for name in ("MUTEXCRON_LOCK_URL", "MUTEXCRON_METRICS_PORT"):
        environment.pop(name, None)
    command = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
               f"--junitxml={report}", *pytest_args]  # fmt: skip
    run = subprocess.run(command, cwd=sdist, env=environment, capture_output=True, text=True, timeout=600)
    if not report.exists():
        pytest.fail(f"APScheduler's tests did not run ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcome = kinds[0] if kinds else "passed"
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = "failed" if outcome == "failure" else outcome
    return outcomes
