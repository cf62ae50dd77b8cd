"""Progress on long CLI work (mutexcron/cli/progress.py): a bar on a terminal, one summary line
elsewhere, and exact counts from the bulk task commands and ``tasks add-many``."""

from __future__ import annotations

import io
import json
from datetime import timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from mutexcron.cli import progress as progress_module
from mutexcron.cli import tasks as cli_tasks
from mutexcron.cli.main import main
from mutexcron.cli.progress import Progress
from mutexcron.tasks import NewTask, task_store_from_url

pytestmark = pytest.mark.sqlite


def cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/tasks.db"


def _add(url: str, count: int, code: str = "bulk_welcome") -> None:
    store = task_store_from_url(url)
    try:
        batch = [NewTask(code, f"user-{i}", timedelta(hours=1), None) for i in range(count)]
        for start in range(0, count, 1000):
            store.add_many(batch[start : start + 1000])
    finally:
        store.close()


def test_a_bulk_cancel_of_exactly_the_limit_says_there_is_no_rest(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_tasks, "BULK_LIMIT", 5)
    _add(url, 5)
    exact = cli("tasks", "cancel", "--code", "bulk_welcome", "--yes", "--lock-url", url)
    assert exact.exit_code == 0, exact.output
    assert "cancelled 5 of 5 tasks" in exact.stdout and "the rest" not in exact.stdout
    _add(url, 7)
    more = cli("tasks", "cancel", "--code", "bulk_welcome", "--yes", "--lock-url", url)
    assert more.exit_code == 0, more.output
    assert "the first 5: run the command again for the rest" in more.stdout
    assert more.stdout.rstrip().endswith("cancelled 5 of 5 tasks; more match: run the command again for the rest")
    last = cli("tasks", "cancel", "--code", "bulk_welcome", "--yes", "--lock-url", url)
    assert "cancelled 2 of 2 tasks" in last.stdout and "the rest" not in last.stdout


def test_long_bulk_work_off_a_terminal_ends_with_one_summary_line(url: str) -> None:
    _add(url, progress_module.BAR_FROM)
    result = cli("tasks", "cancel", "--code", "bulk_welcome", "--yes", "--lock-url", url)
    assert result.exit_code == 0, result.output
    assert f"cancelled {progress_module.BAR_FROM:,} of {progress_module.BAR_FROM:,} tasks" in result.stdout
    [summary] = result.stderr.splitlines()
    assert summary.startswith(f"cancelling: {progress_module.BAR_FROM:,} tasks in ") and summary.endswith(" s")


def test_add_many_shows_its_progress_and_exact_counts(url: str, tmp_path: Path) -> None:
    lines = tmp_path / "tasks.jsonl"
    count = progress_module.BAR_FROM + 500
    lines.write_text("".join(json.dumps({"code": "email", "key": f"k{i}", "due": "+1h"}) + "\n" for i in range(count)))
    result = cli("tasks", "add-many", str(lines), "--lock-url", url)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"{count:,} task(s) from {lines}: {count:,} inserted"
    assert result.stderr.startswith(f"adding: {count:,} tasks in ")
    few = cli("tasks", "add-many", str(lines), "--lock-url", url)
    assert "replaced" in few.stdout


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_a_bar_counts_and_notes_do_not_break_it(monkeypatch: pytest.MonkeyPatch) -> None:
    err = Terminal()
    monkeypatch.setattr("sys.stderr", err)
    with Progress("cancelling", 3000, show=True, unit="tasks") as progress:
        progress.advance(1000)
        progress.note("[12:00:00] a phase begins")
        progress.advance_to(3000)
        assert progress.done == 3000
    shown = err.getvalue()
    assert "cancelling" in shown and "3000/3000" in shown and "[12:00:00] a phase begins" in shown
    assert "tasks in" not in shown, "a terminal gets the bar, not the summary line"


def test_short_work_and_own_reports_print_no_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    with Progress("adding", 10, show=False) as progress:
        progress.advance(10)
    with Progress("drill", 60, show=False, bar_from=0, unit="s", summary=False) as progress:
        progress.note("[12:00:00] warm-up")
        progress.advance_to(60)
    assert err.getvalue() == "[12:00:00] warm-up\n"
