"""``mutexcron drill`` end to end: the CLI as a subprocess, on SQLite and PostgreSQL, with skew and Ctrl-C.

Each drill runs 3 nodes for about 20 s with a 2 s lease. The skew test needs libfaketime (Debian
``faketime``); it is skipped without it, except under ``CI=true``, where ``.ci/run`` installs it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from mutexcron.cli.main import main
from mutexcron.drill import libfaketime
from mutexcron.drill.analysis import analyse
from mutexcron.drill.records import NodeOps, Tick
from mutexcron.drill.report import TERM_LIMIT, DrillReport, PhaseMark, format_report
from mutexcron.locks import lock_store_from_url
from tests.backends import FULL_MATRIX_ONLY, cleanup_sql, require_server, sql_url

UNACTIVE_INTERVAL = 2.0


def _postgresql_url() -> str:
    base = require_server("postgresql")
    return sql_url(base, "mc_drill")


def run_drill_cli(url: str, *extra: str, cwd: Path, timeout: float = 120) -> tuple[dict, str]:
    """Run ``python -m mutexcron drill --json``; return the JSON report and stderr (the progress)."""
    proc = subprocess.run(
        [
            sys.executable, "-m", "mutexcron", "drill", "--lock-url", url, "--nodes", "3",
            "--unactive-interval", str(UNACTIVE_INTERVAL), "--duration", "20", "--json", *extra,
        ],
        cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.stdout, f"no report (exit {proc.returncode}):\n{proc.stderr}"
    report = json.loads(proc.stdout)
    print(f"\n{proc.stderr}{json.dumps(report, indent=1)}")  # visible with -s
    assert proc.returncode == (0 if report["verdict"] == "PASS" else 1), proc.stderr
    return report, proc.stderr


def assert_cleaned_up(stderr: str) -> None:
    workdir = re.search(r" in (\S*mutexcron-drill-\S+)", stderr)
    assert workdir, stderr
    assert not Path(workdir[1]).exists(), f"temp dir {workdir[1]} left behind"
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert workdir[1] not in ps, f"drill nodes still running:\n{ps}"


def drill_summary(report: dict[str, Any], tail: int = 60) -> str:
    """The JSON report, and, when the drill kept its node logs (it did not pass), each log's last lines."""
    parts = [json.dumps(report, indent=1)]
    if report.get("logs"):
        for log in sorted(Path(report["logs"]).glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {log.name} (last {len(lines)} lines)\n" + "\n".join(lines))
    return "\n".join(parts)


#: Synthetic ledgers: the drill's monotonic clock starts at 1000.0 s, and a node's wall clock is
#: it plus WALL, so the drill job's fire times (whole wall seconds) fall on whole monotonic seconds.
WALL = 1_764_000_000.0 - 1000.0


def _tick(node: str, fire_mono: float, ran_at: float, n: int, ahead: float = 0.0) -> Tick:
    """A run of fire time ``fire_mono`` (on the node's clock, ``ahead`` of the drill's) ended at ``ran_at``."""
    return Tick(node=node, fire=fire_mono + WALL, n=n, token=1, mono=ran_at, wall=ran_at + WALL + ahead)


def _term_verdict(
    standby_runs: list[tuple[float, float]], *, stopping_runs: list[tuple[float, float]], standby_ahead: float = 0.0
) -> DrillReport:
    """The verdict on a SIGTERM of n0 at 1000.56: n0 ran 997-1000 (and ``stopping_runs``:
    (fire, ended)), n1 ran ``standby_runs``; the gap set as the drill's scenario sets it. With
    ``standby_ahead``, n1's clock runs that far ahead (a ``--skew`` drill)."""
    at = 1000.56
    ran = [(f, f + 0.02) for f in (997.0, 998.0, 999.0, 1000.0)] + stopping_runs
    ticks = [_tick("n0", f, m, i) for i, (f, m) in enumerate(ran, 1)]
    ticks += [_tick("n1", f, m, len(ticks) + i, standby_ahead) for i, (f, m) in enumerate(standby_runs, 1)]
    report = DrillReport(nodes=3, unactive_interval=2.0, lock="mutexcron-drill-test", skew=standby_ahead)
    report.marks.append(PhaseMark("term", "n0", at))
    first = min((t for t in ticks if t.node != "n0" and t.mono > at), key=lambda t: t.mono)
    report.gaps["term"] = first.mono - at
    moved = (stopping_runs[-1][1] if stopping_runs else at + 0.35) + 0.06
    ops = NodeOps(acquired=[{"lock": report.lock, "node": "n1", "token": 2, "mono": moved}])
    ops.starts = {"n0": {"wall": 990.0 + WALL, "mono": 990.0}, "n1": {"wall": 990.0 + WALL + standby_ahead, "mono": 990.0}}
    return analyse(ticks, report, ops, mono_range=(990.0, 1010.0), wall_minus_mono=WALL)


def test_sigterm_hand_off_is_judged_from_the_fire_time_after_the_stopping_nodes_last_run() -> None:
    """Seen in CI: SIGTERM at t, the stopping node runs the fire time t+0.44 while it hands over,
    the standby runs the next one, t+1.44, at t+1.67: no fire time missed, 0.23 s late: PASS."""
    report = _term_verdict([(1002.0, 1002.23), (1003.0, 1003.02)], stopping_runs=[(1001.0, 1001.02)])
    assert report.passed, report.failures
    hand_off = report.hand_off
    assert hand_off is not None and hand_off.missed == [] and hand_off.last_fire == 1001.0 + WALL
    assert hand_off.next_run == pytest.approx(1.67) and hand_off.due == pytest.approx(1.44)
    assert report.gaps["term"] == pytest.approx(0.23)
    assert report.takeover["term"] == pytest.approx(0.06)  # from the end of its last run
    text = format_report(report)
    assert "lock moved 0.06s after its last run (ended +0.46s), next run 0.23s after the fire time after it was due" in text
    assert "(due +1.44s; ran +1.67s), 0 fire time(s) missed  (limit 1.5s)" in text, text
    assert report.to_json()["gaps_measured_from"]["term"] == "the first fire time due after the stopping node's last run"


def test_sigterm_hand_off_fails_when_a_fire_time_ran_on_no_node() -> None:
    """The stopping node runs t+0.44, the standby's first run is t+2.44 (on time, but t+1.44 ran nowhere): FAIL."""
    report = _term_verdict([(1003.0, 1003.05)], stopping_runs=[(1001.0, 1001.02)])
    assert report.hand_off is not None and report.hand_off.missed == [1002.0 + WALL]
    assert report.failures == [
        "hand-off after SIGTERM: 1 fire time(s) between n0's last run and the first run on another node "
        "ran on no node (16:00:02 UTC)"
    ]  # 1.05 s after t+1.44 was due: within the limit, the miss alone fails it


def test_sigterm_hand_off_without_a_run_on_the_stopping_node_counts_from_the_next_fire_time() -> None:
    """The stopping node hands over before its next fire time (t+0.44): the standby must run that one."""
    report = _term_verdict([(1001.0, 1001.1), (1002.0, 1002.02)], stopping_runs=[])
    assert report.passed, report.failures
    assert report.hand_off is not None and report.hand_off.last_fire is None
    assert report.gaps["term"] == pytest.approx(0.10)  # ran at t+0.54, due at t+0.44
    assert report.takeover["term"] == pytest.approx(0.41)  # from the signal
    late = _term_verdict([(1002.0, 1002.1)], stopping_runs=[])  # t+0.44 lost
    assert late.hand_off is not None and late.hand_off.missed == [1001.0 + WALL]
    assert not late.passed
    slow = _term_verdict([(1002.0, 1004.0)], stopping_runs=[(1001.0, 1001.02)])  # no miss, 2 s after due
    assert slow.failures == [
        "hand-off after SIGTERM: the next run on another node came 2.00s after the fire time due after "
        "n0's last run (limit 1.5s)"
    ]


def test_sigterm_hand_off_to_a_standby_whose_clock_is_ahead_misses_no_fire_time() -> None:
    """--skew: the standby's clock 4 s ahead, the fire times 4 s after the stopping node's last one
    are past on it when it takes over; its first, 1006 on its clock, is the next instant: PASS.
    Two seconds more ahead of that (1008) would leave two instants without a run: FAIL."""
    report = _term_verdict([(1006.0, 1002.05)], stopping_runs=[(1001.0, 1001.02)], standby_ahead=4.0)
    assert report.passed, report.failures
    assert report.hand_off is not None and report.hand_off.missed == []
    late = _term_verdict([(1008.0, 1004.05)], stopping_runs=[(1001.0, 1001.02)], standby_ahead=4.0)
    assert late.hand_off is not None and late.hand_off.missed == [1006.0 + WALL, 1007.0 + WALL]


def assert_drill_passed(report: dict) -> None:
    summary = drill_summary(report)
    assert report["verdict"] == "PASS" and report["failures"] == [], summary
    assert report["ticks"]["duplicated"] == 0, summary
    assert report["attrs"]["repeats"] == 0, summary
    assert report["ticks"]["executed"] >= 10, summary
    for phase in ("kill", "freeze"):
        assert report["takeover_seconds"][phase] <= UNACTIVE_INTERVAL + 1.0, summary
    assert report["takeover_seconds"]["term"] <= TERM_LIMIT, summary
    assert report["term_hand_off"]["missed_fire_times"] == [], summary
    latency = report["store_latency_ms"]
    assert latency["calls"] > 20 and 0 < latency["p50"] <= latency["p99"], summary
    assert "forgotten (their fencing tokens stay spent)" in report["lock_left"], summary


def assert_lock_released(url: str, lock: str) -> None:
    store = lock_store_from_url(url)
    try:
        record = store.read(lock)
    finally:
        store.close()
    assert record is not None and record.holder is None, record


@pytest.mark.cluster
@pytest.mark.sqlite
def test_drill_passes_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/drill.db"
    report, stderr = run_drill_cli(url, cwd=tmp_path)
    assert_drill_passed(report)
    assert report["gaps_seconds"]["kill"] <= UNACTIVE_INTERVAL + 1.0
    assert_cleaned_up(stderr)
    assert_lock_released(url, report["lock"])


@pytest.mark.cluster
@pytest.mark.postgresql
@FULL_MATRIX_ONLY  # CI runs the skewed-clock PostgreSQL drill below (a pass on PostgreSQL too) and the SQLite one
def test_drill_passes_on_postgresql(tmp_path: Path) -> None:
    url = _postgresql_url()
    try:
        report, stderr = run_drill_cli(url, cwd=tmp_path)
        assert_drill_passed(report)
        assert report["gaps_seconds"]["term"] <= TERM_LIMIT
        assert_cleaned_up(stderr)
        assert_lock_released(url, report["lock"])
    finally:
        cleanup_sql(url)


def _require_libfaketime() -> None:
    try:
        libfaketime()
    except Exception as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{exc} (CI=true: .ci/run installs the faketime package)")
        pytest.skip(str(exc))


@pytest.mark.cluster
@pytest.mark.postgresql
def test_drill_with_skewed_node_clocks_passes_on_postgresql(tmp_path: Path) -> None:
    """Node clocks at +0, +4 and +8 s: PostgreSQL's clock judges the leases, so takeovers keep their timing.

    A run may wait for a lagging clock to pass fire times a faster node already claimed (the
    drill allows that wait); nothing may run twice.
    """
    _require_libfaketime()
    url = _postgresql_url()
    try:
        report, stderr = run_drill_cli(url, "--skew", "4", cwd=tmp_path)
        assert_drill_passed(report)
        offsets = sorted(report["clock_offsets_seconds"].values())
        assert offsets == pytest.approx([0.0, 4.0, 8.0], abs=0.3), report
        assert_cleaned_up(stderr)
    finally:
        cleanup_sql(url)


@pytest.mark.sqlite
@pytest.mark.parametrize(
    ("url", "args", "message"),
    [
        ("postgresql://postgres@127.0.0.1:1/none", ["--skew", "4"], "--skew needs libfaketime, which is not installed"),
        ("sqlite:///{tmp}/x.db", ["--skew", "4"], "--skew cannot be simulated with sqlite://"),
        ("memory://", [], "memory:// is private to one process"),
        ("", [], "drill needs the store to test: --lock-url URL"),
    ],
    ids=["no-libfaketime", "sqlite-skew", "memory", "no-url"],
)
def test_drill_refuses_what_it_cannot_run(
    url: str, args: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No libfaketime: the real lookup, over a list of paths that do not exist (patched where it is read).
    monkeypatch.setattr("mutexcron.drill.cluster.LIBFAKETIME_PATHS", (str(tmp_path / "libfaketime.so.1"),))
    monkeypatch.delenv("MUTEXCRON_LOCK_URL", raising=False)
    url_args = ["--lock-url", url.format(tmp=tmp_path)] if url else []
    started = time.monotonic()
    result = CliRunner().invoke(main, ["drill", *url_args, *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert time.monotonic() - started < 5, "a refused drill must not start nodes"
    if "libfaketime" in message:
        assert "apt-get install faketime" in result.output


@pytest.mark.cluster
@pytest.mark.sqlite
def test_ctrl_c_stops_nodes_removes_files_and_releases_the_lock(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/drill.db"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mutexcron", "drill", "--lock-url", url, "--unactive-interval", "2", "--json"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # A shell's background job ignores SIGINT, and an ignored SIGINT is inherited: undo that here.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen = []
    assert proc.stderr is not None
    for line in proc.stderr:  # interrupt once the first failover ran: a new holder holds the lock
        seen.append(line)
        if "kill: next run" in line:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    stderr = "".join(seen) + err
    assert proc.returncode == 130, stderr
    assert "drill interrupted" in stderr and out == ""
    assert_cleaned_up(stderr)
    lock = re.search(r"on lock (mutexcron-drill-[0-9a-f]+)", stderr)
    assert lock, stderr
    assert_lock_released(url, lock[1])


_WRITER = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("CREATE TABLE IF NOT EXISTS t (x)")
conn.execute("BEGIN IMMEDIATE")
conn.execute("INSERT INTO t VALUES (1)")
print("in a write", flush=True)
time.sleep(60)
"""


@pytest.mark.sqlite
def test_sqlite_write_lock_probe_sees_a_stopped_writer(tmp_path: Path) -> None:
    """The drill's SIGSTOP must not land inside a SQLite write (the file would stall for every
    node): the probe it uses sees a stopped process holding the write lock, and its release."""
    from mutexcron.drill.cluster import Cluster, sqlite_write_lock_held

    db = tmp_path / "probe.db"
    url = f"sqlite:///{db}?table=mc_probe"
    assert not sqlite_write_lock_held(url, wait=0.1)  # no file yet: nothing holds it
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(db)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "in a write"
        writer.send_signal(signal.SIGSTOP)
        assert sqlite_write_lock_held(url, wait=0.2)
        # The drill's freeze resumes a node stopped inside a write and stops it again (this one
        # never leaves its write, so every attempt finds it so, and the last stop stays).
        said: list[str] = []
        cluster = Cluster(url, nodes=1, progress=said.append, procs={"writer": writer})  # type: ignore[dict-item]
        try:
            cluster.freeze("writer", attempts=3)
        finally:
            cluster.discard()
        assert len([m for m in said if "stopped inside a SQLite write" in m]) == 2, said
        assert open(f"/proc/{writer.pid}/stat").read().split()[2] == "T"  # stopped
    finally:
        writer.kill()
        writer.wait()
    assert not sqlite_write_lock_held(url, wait=0.2)  # a dead process's lock is gone
    assert not sqlite_write_lock_held("postgresql://u@h/db", wait=0.1)  # only SQLite files are probed
