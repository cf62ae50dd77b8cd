"""``mutexcron drill --placement`` end to end (the CLI as a subprocess: 3 nodes join, one leaves,
one is killed, one comes back, about 20 s) on SQLite and PostgreSQL, its refusals, and its
verdict on made-up measurements (it must be able to fail).

The end-to-end tests assert what must hold on a loaded 2-core machine: every change was followed
(the struck node's locks held elsewhere, the shares balanced again), no fire time ran twice, the
cleanup. The drill's own verdict judges the targets' times; its figures are printed (-s).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from mutexcron.cli.main import main
from mutexcron.drill.placement_report import Change, PlacementDrillReport, format_placement_report, shares_balanced
from tests.backends import FULL_MATRIX_ONLY, cleanup_sql, require_server, sql_url
from tests.test_drill import UNACTIVE_INTERVAL, assert_cleaned_up, drill_summary, run_drill_cli


def assert_every_change_was_followed(report: dict[str, Any]) -> None:
    summary = drill_summary(report)
    assert [c["kind"] for c in report["changes"]] == ["join", "join", "join", "term", "kill", "return"], summary
    assert [len(c["live"]) for c in report["changes"]] == [1, 2, 3, 2, 1, 2], summary
    for change in report["changes"]:
        assert change["balanced_seconds"] is not None, summary
        assert sum(change["shares"].get(node, 0) for node in change["live"]) == report["locks"], summary
        if change["kind"] in ("term", "kill"):
            assert change["moved_seconds"] is not None and change["node"] not in change["shares"], summary
    fire_times = report["fire_times"]
    assert fire_times["doubled"] == 0, summary
    assert fire_times["runs"] > 0 and fire_times["runs"] + fire_times["missed"] == fire_times["expected"], summary
    assert "forgotten (their fencing tokens stay spent)" in report["lock_left"], summary
    failures = "; ".join(report["failures"])
    assert "never" not in failures and "twice" not in failures, summary
    assert (report["verdict"] == "PASS") == (not report["failures"]), summary
    if report["logs"]:  # kept by a FAIL (a move a little late on a loaded machine): not left in /tmp by the suite
        shutil.rmtree(report["logs"], ignore_errors=True)


@pytest.mark.cluster
@pytest.mark.sqlite
def test_placement_drill_follows_every_change_on_sqlite(tmp_path: Path) -> None:
    report, stderr = run_drill_cli(f"sqlite:///{tmp_path}/drill.db", "--placement", cwd=tmp_path, timeout=300)
    assert_every_change_was_followed(report)
    assert report["lease"] == UNACTIVE_INTERVAL
    if report["verdict"] == "PASS":
        assert_cleaned_up(stderr)


@pytest.mark.cluster
@pytest.mark.postgresql
@FULL_MATRIX_ONLY
def test_placement_drill_follows_every_change_on_postgresql(tmp_path: Path) -> None:
    url = sql_url(require_server("postgresql"), "mc_drill_placement")
    try:
        report, stderr = run_drill_cli(url, "--placement", cwd=tmp_path, timeout=300)
        assert_every_change_was_followed(report)
        if report["verdict"] == "PASS":
            assert_cleaned_up(stderr)
    finally:
        cleanup_sql(url)


@pytest.mark.sqlite
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--placement", "--tasks"], "--placement is a drill of its own"),
        (["--placement", "--shared-jobs"], "--placement is a drill of its own"),
        (["--placement", "--skew", "0.5"], "--placement is a drill of its own"),
        (["--placement", "--lock-url", "memory://"], "memory:// is private to one process"),
    ],
    ids=["with-tasks", "with-shared-jobs", "with-skew", "memory"],
)
def test_the_placement_drill_refuses_what_it_cannot_run(args: list[str], message: str, tmp_path: Path) -> None:
    lock = [] if "--lock-url" in args else ["--lock-url", f"sqlite:///{tmp_path}/locks.db"]
    result = CliRunner().invoke(main, ["drill", *lock, *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not list(tmp_path.glob("*.db")), "a refused drill creates nothing"


def test_shares_are_balanced_within_ten_percent_of_the_fair_share_and_only_when_every_lock_is_held() -> None:
    assert shares_balanced({"a": 10, "b": 10, "c": 10}, ["a", "b", "c"], 30)
    assert shares_balanced({"a": 11, "b": 10, "c": 9}, ["a", "b", "c"], 30), "± 1 lock at least"
    assert not shares_balanced({"a": 12, "b": 10, "c": 8}, ["a", "b", "c"], 30)
    assert not shares_balanced({"a": 10, "b": 10, "c": 9}, ["a", "b", "c"], 30), "a lock held by no live node"
    assert not shares_balanced({"a": 15, "b": 15, "gone": 1}, ["a", "b"], 31), "held by a node that left"
    assert shares_balanced({"a": 100, "b": 110, "c": 90}, ["a", "b", "c"], 300) and not shares_balanced(
        {"a": 100, "b": 112, "c": 88}, ["a", "b", "c"], 300
    ), "± 10 % of 100"


def test_the_verdict_fails_on_a_late_move_unbalanced_shares_and_a_double_run() -> None:
    report = PlacementDrillReport(nodes=3, lease=2.0, locks=4, store="sqlite:///x.db")
    report.changes = [
        Change("join", "a", at=100.0, wall=1000.0, live=["a"], balanced=0.5, balanced_limit=4.0, shares={"a": 4}),
        Change(
            "term",
            "a",
            at=110.0,
            wall=1010.0,
            live=["b"],
            moved=1.4,
            moved_limit=1.0,
            balanced=1.4,
            balanced_limit=4.0,
            shares={"b": 4},
        ),
        Change(
            "kill",
            "b",
            at=120.0,
            wall=1020.0,
            live=["c"],
            moved=None,
            moved_limit=3.0,
            balanced=None,
            balanced_limit=4.0,
            shares={"b": 4},
        ),
    ]
    runs = [(job, float(t)) for job in range(4) for t in range(1000, 1030) if not (job == 3 and 1020 <= t < 1023)]
    runs.append((2, 1005.0))  # fire time 1005 of job 2 a second time
    report.count_runs(runs, 1000.0, 1030.0)
    assert not report.passed
    text = "; ".join(report.failures)
    assert "term of a: its locks held elsewhere after 1.40s (limit 1.0s)" in text
    assert "kill of b: its locks held elsewhere after never (timed out) (limit 3.0s)" in text
    assert "kill of b: shares balanced after never (timed out) (limit 4.0s, 2 leases); held: b 4" in text
    assert "1 fire time(s) ran twice (e.g. job 2 at 1005)" in text
    assert (report.expected, report.missed, [c.missed for c in report.changes]) == (120, 3, [0, 0, 3])
    assert report.to_json()["fire_times"] == {"expected": 120, "runs": 118, "missed": 3, "doubled": 1}
    shown = format_placement_report(report)
    assert shown.splitlines()[-1].startswith("FAIL: term of a") and "3 fire time(s) missed" in shown
    report.changes[1].moved, report.changes[2:] = 0.4, []
    report.count_runs([(job, float(t)) for job in range(4) for t in range(1000, 1030)], 1000.0, 1030.0)
    assert report.passed and format_placement_report(report).splitlines()[-1] == "PASS"
