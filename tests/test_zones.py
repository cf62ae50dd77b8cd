"""The zone rule: a lock's record carries the zone its holder computes fire times in, and a node in
another zone refuses the lock's jobs instead of firing at other instants (scheduler.py, heartbeat.py)."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterator
from datetime import datetime

import pytest

from mutexcron import ConfigurationError, LockRecord, MutexScheduler
from mutexcron.cli.ops import format_status
from mutexcron.locks import Node
from mutexcron.locks.memory import MemoryLockStore
from tests.schedulers import shut_down_after, wait_for

pytestmark = pytest.mark.memory


@pytest.fixture
def made() -> Iterator[list[MutexScheduler]]:
    yield from shut_down_after()

DEAD = Node("dead-node", "10.9.9.9")



@pytest.fixture
def url() -> str:
    return f"memory://zones-{secrets.token_hex(4)}"



def node(made: list[MutexScheduler], url: str, node_id: str, zone: str, **job: object) -> MutexScheduler:
    # placement="first": the node started first keeps the lock and the other ticks as its standby, which
    # is what this test watches (balanced placement could hand the lock over, and keeps a standby's
    # jobs without lock_else out of its loop).
    sched = MutexScheduler(lock_url=url, node_id=node_id, timezone=zone, unactive_interval=1, placement="first")
    sched.add_job(print, "cron", id="nightly", mutex="nightly", **({"hour": 3} | job))
    made.append(sched)
    return sched


def test_a_node_in_another_zone_refuses_the_job_with_one_error_naming_both_zones_and_the_fix(
    made: list[MutexScheduler], url: str, caplog: pytest.LogCaptureFixture
) -> None:
    holder = node(made, url, "new-york", "America/New_York", second="*", hour="*")
    holder.start()
    assert wait_for(lambda: (holder.lock_store.read("nightly") or DEAD_RECORD).zone == "America/New_York")
    paris = node(made, url, "paris", "Europe/Paris", second="*", hour="*")
    caplog.set_level(logging.INFO)
    paris.start()
    leases = paris._leases
    assert leases is not None and wait_for(lambda: leases.zone_refusal("nightly") is not None)
    reason = leases.zone_refusal("nightly")
    assert reason is not None and "America/New_York" in reason and "Europe/Paris" in reason and "timezone=" in reason
    assert wait_for(lambda: paris.skipped_runs().get(("nightly", "nightly", "zone-mismatch"), 0) >= 2)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and "time zone" in r.getMessage()]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    record = paris.lock_store.read("nightly")
    assert record is not None and record.holder == "new-york"
    assert "America/New_York" in format_status([record])


def test_a_node_in_another_zone_never_takes_over_a_stale_holder(made: list[MutexScheduler], url: str) -> None:
    """The holder died; a node in its zone takes over, a node in another zone does not."""
    store = MemoryLockStore(url)
    token = store.acquire_or_renew("nightly", DEAD, ttl=0.5).token
    assert store.set_zone("nightly", DEAD, token, "America/New_York")
    paris = node(made, url, "paris", "Europe/Paris")
    paris.start()
    time.sleep(2.0)  # the lease ran out long ago: a takeover would have happened
    record = store.read("nightly")
    assert record is not None and record.holder == DEAD.node_id and record.state == "stale"
    assert paris._leases is not None and paris._leases.zone_refusal("nightly") is not None
    new_york = node(made, url, "new-york", "America/New_York")
    new_york.start()
    assert wait_for(lambda: (store.read("nightly") or record).holder == "new-york")


def test_a_released_lock_goes_to_a_node_in_another_zone_which_records_its_own(made: list[MutexScheduler], url: str) -> None:
    """A graceful release is how a deliberate change of zone rolls out."""
    store = MemoryLockStore(url)
    token = store.acquire_or_renew("nightly", DEAD, ttl=10).token
    assert store.set_zone("nightly", DEAD, token, "America/New_York") and store.release("nightly", DEAD, token)
    paris = node(made, url, "paris", "Europe/Paris")
    paris.start()
    assert wait_for(lambda: (store.read("nightly") or DEAD_RECORD).zone == "Europe/Paris")
    assert (store.read("nightly") or DEAD_RECORD).holder == "paris"
    assert paris._leases is not None and paris._leases.zone_refusal("nightly") is None


def test_same_zone_and_zone_free_jobs_are_never_refused(made: list[MutexScheduler], url: str) -> None:
    a = MutexScheduler(lock_url=url, node_id="a", timezone="Asia/Tokyo", unactive_interval=1)
    b = MutexScheduler(lock_url=url, node_id="b", timezone="Europe/Paris", unactive_interval=1)
    made += [a, b]
    for sched in (a, b):  # interval jobs name the same instants in every zone
        sched.add_job(print, "interval", seconds=60, id="every", mutex="every")
    a.start()
    assert wait_for(lambda: a._leases is not None and "every" in a._leases.held())
    b.start()
    time.sleep(1.2)
    assert b._leases is not None and b._leases.zone_refusal("every") is None
    assert (a.lock_store.read("every") or DEAD_RECORD).zone is None


def test_zone_of_names_the_zone_a_trigger_depends_on() -> None:
    from apscheduler.triggers.cron import CronTrigger
    from apscheduler.triggers.date import DateTrigger
    from apscheduler.triggers.interval import IntervalTrigger

    from mutexcron.guard.firetimes import zone_of

    assert zone_of(CronTrigger(hour=3, timezone="Europe/Paris")) == "Europe/Paris"
    assert zone_of(CronTrigger(hour=3, timezone="Etc/UTC")) == zone_of(CronTrigger(hour=3, timezone="UTC")) == "UTC"
    assert zone_of(DateTrigger(datetime(2030, 1, 1, 3), timezone="Asia/Tokyo")) == "Asia/Tokyo"
    assert zone_of(IntervalTrigger(hours=1, timezone="Asia/Tokyo")) is None


def test_jobs_sharing_a_lock_share_one_zone(url: str) -> None:
    sched = MutexScheduler(lock_url=url, timezone="UTC")
    sched.add_job(print, "cron", hour=3, id="a", mutex="shared")
    with pytest.raises(ConfigurationError, match=r"share lock 'shared'.*time zones UTC and Asia/Tokyo"):
        sched.add_job(print, "cron", hour=3, id="b", mutex="shared", timezone="Asia/Tokyo")
    assert sched.get_job("b") is None


DEAD_RECORD = LockRecord(name="none")  # what a missing record reads as here
