"""The README's and the guides' code blocks run, so the docs cannot drift from the code.

A block runs when its info string marks it (every marker still renders as Python on GitHub and
in the site):

* ```` ```python title="jobs.py" ```` (any title ending in ``.py``): a whole jobs file. It is loaded
  as ``mutexcron run`` loads it (imported, never started) and must give a scheduler with jobs or
  task handlers.
* ```` ```python {.run} ````: a snippet, executed as it is.
* ```` ```pycon ````: an interpreter session, checked with :mod:`doctest` (``...`` matches anything).

Each runs in a fresh directory, with ``MUTEXCRON_LOCK_URL`` set to a SQLite file there.
"""

from __future__ import annotations

import doctest
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from mutexcron.cli.loader import load_scheduler

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.MULTILINE | re.DOTALL)
JOBS_FILE = re.compile(r'^python\s+title="(?P<name>[\w./-]+\.py)"')


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    info: str
    body: str

    @property
    def kind(self) -> str | None:
        if JOBS_FILE.match(self.info):
            return "jobs file"
        if re.match(r"^python\s+\{[^}]*\.run\b", self.info):
            return "run"
        if self.info.split()[:1] == ["pycon"]:
            return "pycon"
        return None

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        body = textwrap.dedent("\n".join(row[len(match["indent"]) :] for row in match["body"].splitlines()))
        found.append(Block(page, line, match["info"].strip(), body))
    return found


MARKED = [block for page in PAGES for block in blocks(page) if block.kind]


@pytest.fixture
def fresh_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MUTEXCRON_LOCK_URL", f"sqlite:///{tmp_path}/docs.db")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.sqlite
@pytest.mark.parametrize("block", MARKED, ids=str)
def test_a_marked_block_runs(block: Block, fresh_directory: Path) -> None:
    if block.kind == "jobs file":
        match = JOBS_FILE.match(block.info)
        assert match is not None
        path = fresh_directory / Path(match["name"]).name
        path.write_text(block.body, encoding="utf-8")
        sched = load_scheduler(str(path))
        declared = getattr(sched, "_pending_jobs", []) or sched.tasks.codes()
        assert declared, f"{block}: a jobs file with no job and no task handler"
        return
    if block.kind == "run":
        exec(compile(block.body, str(block), "exec"), {"__name__": f"docs_{block.line}"})
        return
    test = doctest.DocTestParser().get_doctest(block.body, {"__name__": "docs"}, str(block), str(block.page), block.line)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=sys.stdout.write)
    assert runner.failures == 0, f"{block}: {runner.failures} example(s) differ (the output above)"


def test_the_readme_and_the_first_hour_guides_have_blocks_that_run() -> None:
    """The markers stay: the README's jobs file, and a runnable block on each first-hour page."""
    pages = {block.page.name for block in MARKED}
    assert {"README.md", "index.md", "deployment.md", "api.md"} <= pages, sorted(pages)
    assert any(block.kind == "jobs file" for block in MARKED if block.page.name == "README.md")


def test_the_block_finder_reads_indented_fences_and_every_marker() -> None:
    page = ROOT / "docs" / "index.md"
    text = (
        'a\n\n```python title="jobs.py"\nx = 1\n```\n\n* item\n\n    ```python {.run}\n    y = 2\n    ```\n\n'
        "```pycon\n>>> 1 + 1\n2\n```\n\n```bash\nls\n```\n"
    )
    found = [
        Block(page, text.count("\n", 0, m.start()) + 1, m["info"].strip(), m["body"]) for m in FENCE.finditer(text)
    ]
    assert [b.kind for b in found] == ["jobs file", "run", "pycon", None]
