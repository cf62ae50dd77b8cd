"""``mutexcron drill --shared-jobs`` end to end (the CLI as a subprocess, 3 nodes, about 25 s each)
on a SQLite job store of the drill's own and on a Redis one, its refusals, and its verdict's
analysis on made-up records (it must be able to fail)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from apscheduler.events import EVENT_JOB_MODIFIED, EVENT_JOB_REMOVED
from click.testing import CliRunner

from mutexcron.cli.main import main
from mutexcron.drill.shared_report import Change, Run, SharedDrillReport, Strike, analyse
from tests.backends import cleanup_redis, require_server
from tests.test_drill import assert_cleaned_up, drill_summary, run_drill_cli


def assert_shared_drill_passed(report: dict[str, Any]) -> None:
    summary = drill_summary(report)
    assert report["verdict"] == "PASS", summary
    assert report["runs"]["twice"] == 0 and report["runs"]["total"] >= 30, summary
    assert [s["phase"] for s in report["failover"]] == ["kill", "freeze", "term"], summary
    for strike in report["failover"]:
        assert strike["jobs"] and all(g is not None and g <= strike["limit"] for g in strike["gaps_seconds"].values()), summary
    assert [c["what"] for c in report["changes"]] == ["reschedule", "pause", "remove", "resume"], summary
    for change in report["changes"]:
        assert len(change["seen_seconds"]) >= 2 and all(s is not None and s <= 2.0 for s in change["seen_seconds"].values())
    assert "0 run(s) after its removal" in report["effects"]["remove"], summary
    assert "0 run(s) while paused" in report["effects"]["pause"], summary
    rolling = report["rolling_restart"]["longest_gap_seconds"]
    assert rolling and all(g is not None for g in rolling.values()), summary
    frozen = report["freeze_all"]
    assert frozen["seconds_to_first_run"] and all(
        g is not None and g <= frozen["limit"] for g in frozen["seconds_to_first_run"].values()
    ), summary
    assert "forgotten (their fencing tokens stay spent)" in report["cleanup"], summary


@pytest.mark.cluster
@pytest.mark.sqlite
def test_shared_jobs_drill_passes_on_a_sqlite_job_store(tmp_path: Path) -> None:
    report, stderr = run_drill_cli(f"sqlite:///{tmp_path}/locks.db", "--shared-jobs", cwd=tmp_path)
    assert_shared_drill_passed(report)
    assert "job table mutexcron_drill_" in report["cleanup"] and "dropped" in report["cleanup"]
    assert report["job_store"].startswith("sqlite:///") and "mutexcron-drill-" in report["job_store"]
    assert_cleaned_up(stderr)


@pytest.mark.cluster
@pytest.mark.redis
def test_shared_jobs_drill_passes_on_a_redis_job_store(tmp_path: Path) -> None:
    import redis

    url = require_server("redis")
    # The locks on the same server: a SQLite lock store beside a job store on a server is refused.
    locks = f"{url}{'&' if '?' in url else '?'}namespace=drill-{tmp_path.name[-12:]}"
    try:
        report, stderr = run_drill_cli(locks, "--shared-jobs", "--jobstore", url, cwd=tmp_path)
    finally:
        cleanup_redis(locks)
    assert_shared_drill_passed(report)
    assert "keys deleted" in report["cleanup"]
    tag = report["jobs"][0].rsplit("-", 1)[0]
    client = redis.Redis.from_url(url)
    try:
        assert not client.keys(f"{tag}.*"), "the drill's job store keys were left behind"
    finally:
        client.close()
    assert_cleaned_up(stderr)


@pytest.mark.sqlite
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shared-jobs", "--jobstore", "mongodb://localhost/x"], "the shared-jobs drill runs a SQLAlchemyJobStore"),
        (["--jobstore", "redis://localhost"], "--jobstore is for the shared-jobs drill: add --shared-jobs"),
        (["--shared-jobs", "--tasks"], "--shared-jobs is a drill of its own"),
        (["--shared-jobs", "--lock-url", "memory://"], "memory:// is private to one process"),
        (["--shared-jobs", "--jobstore", "redis://localhost"], "a SQLite file only this host reaches"),
    ],
    ids=["mongodb-jobstore", "jobstore-alone", "with-tasks", "memory-locks", "sqlite-locks-beside-a-server"],
)
def test_the_shared_jobs_drill_refuses_what_it_cannot_run(args: list[str], message: str, tmp_path: Path) -> None:
    lock = [] if "--lock-url" in args else ["--lock-url", f"sqlite:///{tmp_path}/locks.db"]
    result = CliRunner().invoke(main, ["drill", *lock, *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not list(tmp_path.glob("*.db")) or "--lock-url" in args


def test_the_verdict_fails_on_a_double_run_a_late_failover_and_a_change_not_seen() -> None:
    report = SharedDrillReport(nodes=3, lease=2.0, lock_store="x", job_store="y", jobs=["j0", "j1"])
    runs = [Run("j0", "a", float(t), 1, 100.0 + t - 1000, t) for t in range(1000, 1010)]
    runs.append(Run("j0", "b", 1005.0, 2, 105.2, 1005.2))  # fire time 1005 a second time
    runs += [Run("j1", "a", float(t), 1, 100.0 + t - 1000, t) for t in range(1000, 1004)]
    runs.append(Run("j1", "b", 1010.0, 2, 110.5, 1010.5))  # 6 s after the kill at 1004.1
    report.strikes.append(Strike("kill", "a", 104.1, 1004.1, ["j1"]))
    report.changes.append(Change("remove", "j0", 106.0, EVENT_JOB_REMOVED, ["a", "b"]))
    report.changes.append(Change("reschedule", "j1", 101.0, EVENT_JOB_MODIFIED, ["a"]))
    events = [{"event": EVENT_JOB_REMOVED, "job": "j0", "node": "a", "mono": 106.1}]
    analyse(report, runs, events)
    text = "; ".join(report.failures)
    assert not report.passed
    assert "(job, fire time) ran more than once" in text
    assert "job j1 ran elsewhere after 5.50s (limit 3.0s)" in text
    assert "remove of j0: node b saw it after never" in text and "reschedule of j1: node a saw it after never" in text
    assert "removed job j0 ran 2 time(s) after its removal" in text


def test_a_sigterm_hand_off_counts_from_the_fire_time_after_the_stopping_nodes_last_run() -> None:
    """Balanced placement: a stopping node runs the fire time due during its hand-over wait, then
    hands over; the next node's first run is the fire time after that one. Counted from the first
    fire time after the signal, a 2 s job's hand-off measured 2.00 s against the 1.5 s limit (seen
    once in CI) although no fire time was missed. A fire time missed after it still fails."""
    def verdict(elsewhere: float) -> list[str]:
        report = SharedDrillReport(nodes=3, lease=2.0, lock_store="x", job_store="y", jobs=["j1"])
        runs = [Run("j1", "a", float(t), 1, 100.0 + t - 1000, t) for t in range(1000, 1008, 2)]  # ..., 1006 after the signal
        runs.append(Run("j1", "b", elsewhere, 2, 100.0 + elsewhere - 1000 + 0.01, elsewhere + 0.01))
        report.strikes.append(Strike("term", "a", 105.5, 1005.5, ["j1"]))
        analyse(report, runs, [])
        return [f for f in report.failures if "after term" in f]

    assert verdict(1008.0) == [], "the fire time after the stopping node's last run, at once"
    assert verdict(1010.0) and "ran elsewhere after 2.01s" in verdict(1010.0)[0], "1008 ran on no node"



def test_the_interval_is_read_from_the_latest_fire_times_not_from_before_a_reschedule() -> None:
    """The drill reschedules a 1 s job to every 2 s. Read from every run, its interval looked like
    1 s: the fire time after the signal was put 1 s early, and an on-time hand-off measured 1.0 s
    (limit 1.5 s: any lag above 0.5 s failed it)."""
    report = SharedDrillReport(nodes=3, lease=2.0, lock_store="x", job_store="y", jobs=["j1"])
    runs = [Run("j1", "a", float(t), 1, 100.0 + t - 1000, t) for t in range(990, 1000)]  # every 1 s
    runs += [Run("j1", "a", float(t), 1, 100.0 + t - 1000, t) for t in range(1000, 1006, 2)]  # then every 2 s
    runs.append(Run("j1", "b", 1006.0, 2, 100.0 + 6 + 0.01, 1006.01))
    report.strikes.append(Strike("term", "a", 104.5, 1004.5, ["j1"]))  # after the run of 1004
    analyse(report, runs, [])
    assert report.failures == [] and report.strikes[0].gaps["j1"] == pytest.approx(0.01), report.strikes[0].gaps
