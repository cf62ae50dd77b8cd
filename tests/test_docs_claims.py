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


def test_the_readme_test_command_is_the_one_ci_runs_and_says_what_it_needs() -> None:
    """`.ci/run` runs the README's test command verbatim; next to it the README says the suite needs
    the three servers and about 25 minutes, and gives a subset that needs none."""
    root = DOCS.parent
    ci = (root / ".ci" / "run").read_text(encoding="utf-8")
    body = ci.split("readme_tests() {", 1)[1].split("\n}", 1)[0]
    command = next(line for line in body.splitlines() if line and not line.startswith("#"))
    readme = (root / "README.md").read_text(encoding="utf-8")
    assert command in readme.splitlines(), "the README's test command differs from the one .ci/run runs"
    quickstart = " ".join(readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0].split())
    for needed in ("MariaDB, PostgreSQL and Redis", "about 25 minutes", 'python -m pytest -m "memory and not cluster"'):
        assert needed in quickstart, needed
    assert len(readme.split()) < 800, "the README sells in one screen: details belong in docs/"


#: The pages of the first hour and the guides this diet covers: each opens with what the reader can do.
OPENING_PAGES = ("index", "deployment", "operations", "guarantees", "cli", "api", "embedding", "migration", "mutex",
                 "reference", "testing", "dashboard", "architecture")  # fmt: skip


def test_each_page_opens_with_what_the_reader_will_be_able_to_do() -> None:
    for name in OPENING_PAGES:
        text = (DOCS / f"{name}.md").read_text(encoding="utf-8")
        first = text.split("\n\n", 2)[1]  # the paragraph after the title
        assert first.startswith("**After this page** you can"), f"{name}.md opens with {first[:60]!r}"
    assert (DOCS / "glossary.md").exists()


def test_no_line_runs_on_from_a_table() -> None:
    """A line right after a table's last row is read as one more row (the README once lost a
    paragraph that way): every table ends with a blank line."""
    for page in [DOCS.parent / "README.md", *DOCS.glob("*.md")]:
        lines = page.read_text(encoding="utf-8").splitlines()
        in_fence = False
        for number, (line, after) in enumerate(zip(lines, [*lines[1:], ""]), start=1):
            if line.lstrip().startswith("```"):
                in_fence = not in_fence
            if in_fence or not line.startswith("|"):
                continue
            assert after.startswith("|") or not after.strip(), f"{page.name}:{number + 1} runs on from a table"
