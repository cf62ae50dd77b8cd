"""Statements in the docs checked against the code (a default, an option, an exit code)."""

from __future__ import annotations

import re
from pathlib import Path

from tzlocal import get_localzone

from mutexcron import MutexScheduler

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_the_guides_give_the_zone_default_the_scheduler_has() -> None:
    """Fire times are in the host's zone unless the scheduler or a trigger names one (as in
    APScheduler): no guide may advise leaving a "UTC default" that does not exist."""
    sched = MutexScheduler(lock_url="memory://")
    assert str(sched.timezone) == str(get_localzone())
    for page in DOCS.glob("*.md"):
        text = " ".join(page.read_text(encoding="utf-8").split())
        for wrong in (r"computed in UTC unless", r"default \(UTC\)", r"UTC by default"):
            assert not re.search(wrong, text), f"{page.name}: {wrong!r} contradicts the code (the host's zone)"
    deployment = " ".join((DOCS / "deployment.md").read_text(encoding="utf-8").split())
    assert "the host's zone" in deployment
