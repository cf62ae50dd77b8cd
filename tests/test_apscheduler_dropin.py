"""A drop-in for APScheduler: its own scheduler tests pass with mutexcron's mixin exactly as without.

APScheduler's source distribution carries its ``tests/``. This test downloads it with pip (never
committed; :mod:`tests.apscheduler_sdist`), runs its ``tests/test_schedulers.py`` twice, as
published and with ``tests/dropin/mutexcron_dropin.py`` substituting ``MutexSchedulerMixin`` into
its ``DummyScheduler`` and mutexcron's schedulers for its Background, Blocking and AsyncIO ones,
and requires the same outcome for every test. Without network it skips, except under ``CI=true``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.apscheduler_sdist import apscheduler_sdist, run_apscheduler_tests

pytestmark = pytest.mark.memory

#: Tests of test_schedulers.py that pass as published with the packages this project installs.
PUBLISHED_PASSES = 186


@pytest.fixture(scope="module")
def apscheduler_tests(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The unpacked source distribution (its ``tests/`` and ``pyproject.toml``)."""
    yield apscheduler_sdist(tmp_path_factory.mktemp("apscheduler-sdist"))


def _outcomes(sdist: Path, report: Path, *plugin: str) -> dict[str, str]:
    """Run its test_schedulers.py in a subprocess; ``{test id: passed|failed|error|skipped}``."""
    return run_apscheduler_tests(sdist, "tests/test_schedulers.py", report, *plugin)


def test_apschedulers_scheduler_tests_pass_with_the_mixin_exactly_as_without(apscheduler_tests: Path, tmp_path: Path) -> None:
    published = _outcomes(apscheduler_tests, tmp_path / "published.xml")
    mixed = _outcomes(apscheduler_tests, tmp_path / "mixin.xml", "-p", "mutexcron_dropin")
    passed = sorted(t for t, o in published.items() if o == "passed")
    assert len(passed) >= PUBLISHED_PASSES, f"as published only {len(passed)} pass: {published}"
    assert not [t for t, o in published.items() if o in ("failed", "error")]
    differ = {t: (published.get(t), mixed.get(t)) for t in published.keys() | mixed.keys() if published.get(t) != mixed.get(t)}
    assert not differ, f"{len(differ)} of APScheduler's scheduler tests differ with the mixin (published, mixin): {differ}"
