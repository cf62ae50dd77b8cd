"""Every name typed on the command line that matches nothing gets the closest names the store or
the jobs file has: locks and jobs (`history`, `jobs show|pause|run`), task codes and keys
(`tasks get|cancel|retry`, also with --code); `tasks add-many` names lines, counted from 1."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from mutexcron.cli.main import main
from mutexcron.locks import lock_store_from_url
from mutexcron.locks.base import FireClaim, Node
from mutexcron.tasks import task_store_from_url
from tests.test_cli_reads import JOBS  # one guarded job: close_invoices, lock billing

pytestmark = pytest.mark.sqlite
NODE = Node("node-a:1:aa", "10.0.0.1")


def cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path}/ops.db"
    locks = lock_store_from_url(url)
    try:
        locks.acquire_or_renew("reports", NODE, ttl=60, claim=FireClaim.new("nightly-report", 1_000_000))
    finally:
        locks.close()
    tasks = task_store_from_url(url)
    try:
        for key in ("order-1", "order-2", "order-30"):
            tasks.add("close_order", key, timedelta(hours=1))
    finally:
        tasks.close()
    return url


def test_history_of_a_mistyped_name_suggests_the_right_one_and_fails(url: str) -> None:
    result = cli("history", "nightly-reprt", "--lock-url", url)
    assert result.exit_code == 1, result.output
    assert "no lock or job 'nightly-reprt'" in result.output and "did you mean 'nightly-report'" in result.output
    assert cli("history", "reports", "--lock-url", url).exit_code == 0
    assert cli("history", "nightly-report", "--lock-url", url).exit_code == 0  # a known job without runs yet


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["tasks", "cancel", "close_ordr", "order-1"], "did you mean 'close_order'"),
        (["tasks", "get", "close_ordr", "order-1"], "did you mean 'close_order'"),
        (["tasks", "retry", "close_ordr", "order-1"], "did you mean 'close_order'"),
        (["tasks", "get", "close_order", "order-3"], "did you mean 'order-30'"),
        (["tasks", "cancel", "close_order", "ordr-2"], "did you mean 'order-2'"),
        (["tasks", "cancel", "nothing_like_it", "k"], "no task has the code 'nothing_like_it'"),
        (["tasks", "cancel", "--code", "close_ordr", "--yes"], "did you mean 'close_order'"),
        (["tasks", "retry", "--all-failed", "--code", "close_ordr", "--yes"], "did you mean 'close_order'"),
    ],
)
def test_a_mistyped_task_code_or_key_gets_the_closest_ones(url: str, args: list[str], says: str) -> None:
    result = cli(*args, "--lock-url", url)
    assert says in result.output, result.output
    assert len(task_store_from_url(url).list(code="close_order")) == 3, "nothing was changed"


@pytest.mark.parametrize("verb", ["show", "run", "pause"])
def test_a_mistyped_job_id_gets_the_closest_one(url: str, tmp_path: Path, verb: str) -> None:
    jobs = tmp_path / "jobs.py"
    jobs.write_text(JOBS)
    result = cli("jobs", verb, str(jobs), "close_invoics", "--lock-url", url)
    assert result.exit_code != 0
    if verb != "pause":  # pause needs a shared job store: it says so first
        assert "did you mean 'close_invoices'" in result.output, result.output


def test_add_many_names_the_lines_of_a_duplicate_counting_from_one(url: str, tmp_path: Path) -> None:
    lines = tmp_path / "tasks.jsonl"
    task = '{"code": "a", "key": "k1", "due": "+1h"}\n'
    lines.write_text(task + "\n" + '{"code": "a", "key": "k2", "due": "+1h"}\n' + task)
    result = cli("tasks", "add-many", str(lines), "--lock-url", url)
    assert result.exit_code == 2
    assert f"{lines}, line 4: ('a', 'k1') is line 1 too; give each task once" in result.output
