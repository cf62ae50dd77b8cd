"""``mutexcron history``, ``pause``, ``resume`` and ``status`` (nodes, pauses, last runs, ``--watch``).

On SQLite files (what a node and the CLI share on one host); the store side of each command is
checked on every backend by ``tests/test_contract.py``.
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from mutexcron.cli import ops as cli_ops
from mutexcron.cli.main import main
from mutexcron.locks import FireClaim, Node, Presence, RunInfo, lock_store_from_url
from mutexcron.node import NodeTraits

pytestmark = pytest.mark.sqlite

WEB1 = Node("web-1:42:abcd", "10.1.2.3")
WEB2 = Node("web-2:7:ef01", "10.1.2.4")


def at(minute: int) -> datetime:
    return datetime(2030, 1, 1, 0, minute, tzinfo=timezone.utc)


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A SQLite store where web-1 ran billing's two jobs and reports (one failure), and both nodes announced themselves."""
    url = f"sqlite:///{tmp_path}/locks.db"
    store = lock_store_from_url(url)
    token = store.acquire_or_renew("billing", WEB1, ttl=30, claim=FireClaim.new("jobs.charge", 1)).token
    store.hand_off("billing", WEB1, token, {"cursor": 1}, RunInfo(0.5, None, job="jobs.charge", fire_time=at(1)))
    store.hand_off("billing", WEB1, token, None, RunInfo(1.5, "ValueError: bad row", job="jobs.charge", fire_time=at(2)))
    store.hand_off("billing", WEB1, token, None, RunInfo(0.2, None, job="jobs.invoice", fire_time=at(2)))
    time.sleep(0.003)  # SQLite's clock stamps runs to the millisecond: the report must end last
    reports = store.acquire_or_renew("reports", WEB1, ttl=30).token
    store.hand_off("reports", WEB1, reports, None, RunInfo(3.0, None, job="jobs.report", fire_time=at(3)))
    store.renew_many(WEB1, {"billing": token, "reports": reports}, presence=Presence("1.2.3", 0.012))
    store.renew_many(WEB2, {}, presence=Presence("1.2.3", None))
    store.close()
    return url


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def test_pause_and_resume_set_the_flag_for_every_node(url: str) -> None:
    result = invoke("pause", "billing", "--lock-url", url, "--by", "alice")
    assert result.exit_code == 0, result.output
    assert "billing: paused by alice" in result.output and "held by web-1:42:abcd (token 1)" in result.output
    store = lock_store_from_url(url)
    rec = store.read("billing")
    assert rec is not None and rec.paused and rec.paused_by == "alice" and rec.holder == WEB1.node_id
    assert not store.acquire_or_renew("billing", WEB1, ttl=30, claim=FireClaim.new("jobs.charge", 5)).claimed
    result = invoke("resume", "billing", "--catch-up", "--timeout", "0", "--lock-url", url)
    assert result.exit_code == 0 and "billing: resumed by " in result.output
    assert "catch-up requested: jobs.charge" in result.output  # a trigger request per job
    assert "jobs.charge: requested (fire time " in result.output and "not waited for" in result.output
    rec = store.read("billing")
    assert rec is not None and not rec.paused and rec.resume_catch_up and "@" in (rec.paused_by or "")
    with_wait = invoke("resume", "billing", "--catch-up", "--timeout", "0.5", "--lock-url", url)
    assert with_wait.exit_code == 1, with_wait.output  # no node runs here: said, and exit 1 (issue 32, C1)
    assert "jobs.charge: not run yet within 0.5s (request of fire time " in with_wait.output, with_wait.output
    fresh = invoke("pause", "nightly", "--force", "--lock-url", url)
    assert fresh.exit_code == 0 and "no node has taken it yet: it starts paused" in fresh.output
    again = invoke("resume", "reports", "--lock-url", url)
    assert again.exit_code == 0 and "(it was not paused)" in again.output
    store.close()


def test_history_by_lock_by_job_and_of_everything(url: str) -> None:
    by_lock = invoke("history", "billing", "--lock-url", url)
    assert by_lock.exit_code == 0, by_lock.output
    lines = by_lock.output.splitlines()
    assert lines[0].split()[:4] == ["ENDED", "(UTC)", "JOB", "LOCK"] and len(lines) == 4
    assert "jobs.invoice" in lines[1] and "ValueError: bad row" in lines[2] and " error " in lines[2]
    only = invoke("history", "billing", "--job", "jobs.charge", "--lock-url", url, "--json")
    runs = json.loads(only.output)["runs"]
    assert [(r["job"], r["outcome"], r["fire_time"]) for r in runs] == [
        ("jobs.charge", "error", "2030-01-01T00:02:00+00:00"),
        ("jobs.charge", "success", "2030-01-01T00:01:00+00:00"),
    ]
    assert runs[0]["node"] == WEB1.node_id and runs[0]["duration"] == pytest.approx(1.5, abs=0.002)
    by_job = json.loads(invoke("history", "jobs.report", "--lock-url", url, "--json").output)["runs"]
    assert [(r["lock"], r["job"]) for r in by_job] == [("reports", "jobs.report")]
    everything = json.loads(invoke("history", "--lock-url", url, "--json", "--limit", "3").output)["runs"]
    assert [r["job"] for r in everything] == ["jobs.report", "jobs.invoice", "jobs.charge"]
    none = invoke("history", "nope", "--lock-url", url)
    assert none.exit_code == 1 and "no lock or job 'nope'" in none.output


def test_status_shows_pauses_nodes_and_each_jobs_last_run(url: str) -> None:
    invoke("pause", "reports", "--lock-url", url, "--by", "ops")
    result = invoke("status", "--lock-url", url)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("lock store: sqlite:///") and "(2 locks)" in lines[0]
    assert lines[1].split()[:6] == ["NAME", "HOLDER", "ACTIVE_IP", "HEARTBEAT", "STATE", "PAUSED"]
    assert " paused " in next(line for line in lines if line.startswith("reports"))
    assert " - " in next(line for line in lines if line.startswith("billing"))
    nodes = lines.index("nodes (2 seen in the last 10 minutes):")
    assert lines[nodes + 1].split()[:4] == ["NODE", "STATE", "IP", "VERSION"]
    web1 = lines[nodes + 2]
    assert web1.startswith(WEB1.node_id) and web1.split()[1] == "live"
    assert "10.1.2.3" in web1 and "1.2.3" in web1 and "+0.012s" in web1
    assert "billing, reports" in web1 and lines[nodes + 3].startswith(WEB2.node_id)
    assert "  reports (by ops since " in result.output and "`mutexcron resume reports`" in result.output
    last = lines.index("last run of each job:")
    jobs = [line.split()[2] for line in lines[last + 2 : last + 5]]
    assert jobs == ["jobs.charge", "jobs.invoice", "jobs.report"]
    assert "ValueError: bad row" in lines[last + 2]
    data = json.loads(invoke("status", "--lock-url", url, "--json").output)
    assert set(data) == {"store", "locks", "nodes", "paused", "last_runs", "tasks"}
    assert data["paused"] == ["reports"] and [n["node_id"] for n in data["nodes"]] == [WEB1.node_id, WEB2.node_id]
    assert {(r["lock"], r["job"]) for r in data["last_runs"]} == {
        ("billing", "jobs.charge"),
        ("billing", "jobs.invoice"),
        ("reports", "jobs.report"),
    }
    assert next(lock for lock in data["locks"] if lock["name"] == "reports")["paused"] is True


def test_status_shows_each_nodes_share_fair_share_weight_and_tags(tmp_path: Path) -> None:
    """Issue 33: a node's share of the locks, its fair share by weight among the live nodes, its weight and tags."""
    url = f"sqlite:///{tmp_path}/locks.db"
    store = lock_store_from_url(url)
    tokens = {name: store.acquire_or_renew(name, WEB1, ttl=30).token for name in ("a", "b", "c", "d", "e")}
    store.renew_many(WEB1, tokens, presence=Presence("1.2.3", traits=NodeTraits(2.0, ("eu", "reports"))))
    store.acquire_or_renew("f", WEB2, ttl=30)
    store.renew_many(WEB2, {"f": 1}, presence=Presence("1.2.3"))
    store.close()
    result = invoke("status", "--lock-url", url)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    header = lines[lines.index("nodes (2 seen in the last 10 minutes):") + 1]
    assert header.split()[-5:] == ["SHARE", "FAIR", "WEIGHT", "TAGS", "LOCKS"]
    web1 = next(line for line in lines if line.startswith(WEB1.node_id))
    assert re.split(r"\s{2,}", web1.strip())[-5:] == ["5 of 6 (83%)", "4", "2", "eu, reports", "a, b, c, d, e"], web1
    web2 = next(line for line in lines if line.startswith(WEB2.node_id))
    assert re.split(r"\s{2,}", web2.strip())[-5:] == ["1 of 6 (17%)", "2", "1", "-", "f"], web2
    data = {n["node_id"]: n for n in json.loads(invoke("status", "--lock-url", url, "--json").output)["nodes"]}
    one, two = data[WEB1.node_id], data[WEB2.node_id]
    assert (one["weight"], one["tags"], one["share"], one["fair_share"]) == (2.0, ["eu", "reports"], 5, 4)
    assert (two["weight"], two["tags"], two["share"], two["fair_share"]) == (1.0, [], 1, 2)


def test_status_watch_prints_once_off_a_terminal(url: str) -> None:
    result = invoke("status", "--lock-url", url, "--watch")
    assert result.exit_code == 0 and result.output.count("lock store:") == 1 and "Ctrl-C" not in result.output


def test_status_watch_redraws_on_a_terminal_until_ctrl_c(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    clears: list[int] = []
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(cli_ops, "_on_terminal", lambda: True)
    monkeypatch.setattr(cli_ops.click, "clear", lambda: clears.append(1))
    monkeypatch.setattr(cli_ops.time, "sleep", sleep)
    result = invoke("status", "--lock-url", url, "--watch", "--interval", "0.5")
    assert result.exit_code == 0, result.output
    assert len(clears) == 2 and sleeps == [0.5, 0.5] and result.output.count("lock store:") == 2
    assert "(every 0.5s; Ctrl-C to stop)" in result.output


def test_store_errors_exit_1_without_a_traceback(tmp_path: Path) -> None:
    result = invoke("pause", "x", "--lock-url", "postgresql://bob:hunter2@127.0.0.1:1/x")
    assert result.exit_code == 1 and "hunter2" not in result.output and "pause" in result.output
    bad = invoke("history", "--lock-url", f"sqlite:///{tmp_path}/x.db?history=1001")
    assert bad.exit_code == 2 and "history" in bad.output


def test_status_with_a_history_length_in_the_url(url: str) -> None:
    result = invoke("status", "--lock-url", f"{url}?history=5", "--json")
    assert result.exit_code == 0, result.output
    assert "history=" not in json.loads(result.output)["store"]


# -- names and --by (issue 22, item 11) --------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (("pause", "bill\ning"), "bad lock name"),
        (("pause", "x" * 192), "bad lock name"),
        (("resume", "bill\x1b[2Jing"), "bad lock name"),
        (("pause", "billing", "--by", "eve\nERROR lock 'billing' taken over by attacker"), "bad --by"),
        (("resume", "billing", "--by", "e" * 300), "bad --by"),
    ],
)
def test_pause_and_resume_refuse_bad_names_and_by_and_change_nothing(url: str, args: tuple[str, ...], problem: str) -> None:
    result = invoke(*args, "--lock-url", url)
    assert result.exit_code == 2 and problem in result.output, result.output
    store = lock_store_from_url(url)
    try:
        assert [(r.name, r.paused, r.paused_by) for r in store.list()] == [("billing", False, None), ("reports", False, None)]
    finally:
        store.close()


def test_an_operators_text_is_escaped_in_every_log_line_and_status(url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Stores written by other means (an older CLI, the API) may hold anything: logged and shown escaped."""
    from mutexcron.events import EVENT_LOCK_PAUSED, MutexEvent, log_event

    forged = "eve\n2030-01-01 ERROR lock 'billing' taken over by attacker\x1b[2J"
    store = lock_store_from_url(url)
    try:
        store.set_paused("billing", True, forged)
    finally:
        store.close()
    caplog.set_level("WARNING")
    log_event(MutexEvent(EVENT_LOCK_PAUSED, lock="billing", paused_by=forged))
    (line,) = [r.getMessage() for r in caplog.records if "is paused" in r.getMessage()]
    assert "\n" not in line and "\x1b" not in line and "eve\\n2030-01-01 ERROR" in line
    shown = invoke("status", "--lock-url", url).output
    assert "taken over by attacker" in shown and "\x1b" not in shown
    assert not any(row.startswith("2030-01-01 ERROR") for row in shown.splitlines())


# -- unknown names and forget (issue 25, item 6) --------------------------------------------------------
def _records(url: str) -> list[tuple[str, bool]]:
    store = lock_store_from_url(url)
    try:
        return [(r.name, r.paused) for r in store.list()]
    finally:
        store.close()


def test_pause_and_resume_of_an_unknown_name_are_refused_unless_forced(url: str) -> None:
    typo = invoke("pause", "biling", "--lock-url", url)
    assert typo.exit_code == 2, typo.output
    assert "no lock 'biling'" in typo.output and "did you mean 'billing'?" in typo.output and "--force" in typo.output
    assert _records(url) == [("billing", False), ("reports", False)], "no phantom record"
    resumed = invoke("resume", "nope", "--lock-url", url)
    assert resumed.exit_code == 2 and "no lock 'nope'" in resumed.output and _records(url)[-1] == ("reports", False)
    forced = invoke("pause", "nightly", "--force", "--lock-url", url)
    assert forced.exit_code == 0 and ("nightly", True) in _records(url)


def test_forget_deletes_a_phantom_refuses_a_live_lease_and_forgets_a_node(url: str) -> None:
    invoke("pause", "biling", "--force", "--lock-url", url)
    gone = invoke("forget", "biling", "--lock-url", url)
    assert gone.exit_code == 0 and "biling: forgotten (record deleted" in gone.output, gone.output
    assert _records(url) == [("billing", False), ("reports", False)]
    missing = invoke("forget", "biling", "--lock-url", url)
    assert missing.exit_code == 2 and "did you mean 'billing'?" in missing.output

    held = invoke("forget", "billing", "--lock-url", url)  # web-1's 30 s lease is live
    assert held.exit_code == 1 and "held by web-1:42:abcd (token 1" in held.output and "--force" in held.output
    forced = invoke("forget", "billing", "--force", "--lock-url", url)
    assert forced.exit_code == 0, forced.output
    assert "taken from web-1:42:abcd" in forced.output and "its token 1 stays spent" in forced.output
    store = lock_store_from_url(url)
    try:
        rec = store.read("billing")
        assert rec is not None and (rec.holder, rec.token, dict(rec.attrs), rec.fire_times) == (None, 1, {}, {})
        assert store.history("billing") == [] and store.acquire_or_renew("billing", WEB2, ttl=30).token == 2
    finally:
        store.close()

    live = invoke("forget", "--node", WEB2.node_id, "--lock-url", url)
    assert live.exit_code == 1 and "it is running" in live.output
    node = invoke("forget", "--node", WEB2.node_id, "--force", "--lock-url", url)
    assert node.exit_code == 0 and f"node {WEB2.node_id}: forgotten" in node.output
    shown = json.loads(invoke("status", "--lock-url", url, "--json").output)["nodes"]
    assert [n["node_id"] for n in shown] == [WEB1.node_id]
    assert invoke("forget", "--lock-url", url).exit_code == 2  # neither a lock nor --node
