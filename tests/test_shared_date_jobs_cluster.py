"""A shared date job rescheduled as its run starts keeps its lock and runs again, with real
``mutexcron run`` nodes (issue #32, A8; the in-process test is in tests/test_shared_date_jobs.py).

The holder's loop reads the due date job, submits its run, then removes the job, only if nobody
changed it meanwhile. Another process reschedules it in between (the nodes' removal is slowed to
make room for it, as a loaded database would): the removal is refused, and the job must run again at its
new date, once, and then be removed. Before, the holder still sent ``EVENT_JOB_REMOVED``, dropped
the job's guard and released its lock: the rescheduled run never happened, and the job stayed in
the store.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from apscheduler.events import EVENT_JOB_REMOVED

from mutexcron import MutexScheduler
from tests import shared_jobs
from tests.backends import backend_params_full_matrix
from tests.shared_jobs import JobStoreCtx, jobstore_from_spec
from tests.test_shared_cluster import Cluster, jobstore, lock_url, wait_for

__all__ = ["jobstore", "lock_url"]  # fixtures

pytestmark = pytest.mark.cluster

#: Seconds the nodes' loop waits before removing a finished date job: the room for the reschedule.
REMOVAL_DELAY = 4.0


@pytest.mark.parametrize("kind", backend_params_full_matrix(("sqlite", "postgresql"), ("mysql", "redis")))
def test_a_date_job_rescheduled_as_its_run_starts_runs_again_on_real_nodes(
    kind: str, lock_url: str, jobstore: JobStoreCtx, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARED_TEST_REMOVAL_DELAY", str(REMOVAL_DELAY))  # read by tests/nodes/shared_store_jobs.py
    cluster = Cluster(lock_url, jobstore, tmp_path)
    admin = MutexScheduler(jobstores={"default": jobstore_from_spec(jobstore.spec)}, lock_url=lock_url, triggers=False)
    admin.start(paused=True)
    try:
        cluster.start(1)  # the set-up: a lone holder (a standby would take the released lock)
        first = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(seconds=4)
        admin.add_job(shared_jobs.tick, "date", run_date=first, id="once-more", kwargs={"job": "once-more"})
        wait_for(lambda: [e for e in cluster.events() if e["event"] == "removing"], 30, "the loop's removal", cluster)
        removing = next(e["wall"] for e in cluster.events() if e["event"] == "removing")
        # After the removal's end: a date run later than its grace would be skipped as missed.
        again = datetime.fromtimestamp(int(removing + REMOVAL_DELAY) + 2, timezone.utc)
        admin.reschedule_job("once-more", trigger="date", run_date=again)  # while the holder's removal waits
        wait_for(lambda: len(cluster.runs()) >= 2, 30, "the rescheduled run", cluster)
        wait_for(lambda: admin.get_job("once-more") is None, 20, "the job removed after its last run", cluster)
        fires = sorted(r["fire"] for r in cluster.runs())
        assert fires == [first.timestamp(), again.timestamp()], (fires, cluster.logs())
        assert max(Counter(r["fire"] for r in cluster.runs()).values()) == 1
        removed = [e for e in cluster.events() if e["event"] == EVENT_JOB_REMOVED and e["job"] == "once-more"]
        assert len([e for e in cluster.events() if e["event"] == "removing"]) == 2, "a removal refused, then the real one"
        holder = cluster.runs()[-1]["node"]
        assert [e["node"] for e in removed if e["node"] == holder] == [holder], "removed once, for the real removal"
        assert "not removed" in cluster.logs(), "the refused removal was said"
    finally:
        cluster.stop_all()
        admin.shutdown(wait=False)
