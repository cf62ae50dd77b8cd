"""The event feed (mutexcron/observability/feed/): each store family keeps it bounded, stamped by
its clock and read newest first with filters; a node's writer keeps what happened (a failed run
with its traceback, masked and bounded; a task failed for good; the node joined and stopped)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mutexcron import MutexScheduler
from mutexcron.locks import lock_store_from_url
from mutexcron.observability.feed import FeedEvent, FeedStore, feed_store_for
from mutexcron.observability.feed.writer import MAX_DETAIL, traceback_text
from tests.backends import backend_params, open_backend
from tests.schedulers import wait_for


@pytest.fixture(params=backend_params("memory", "sqlite", "mysql", "postgresql", "redis", "mongomock"))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FeedStore]:
    with open_backend(request.param, tmp_path) as ctx:
        found = feed_store_for(ctx.make())
        assert found is not None
        yield found


def test_a_feed_keeps_events_newest_first_filtered_and_bounded(store: FeedStore) -> None:
    events = [FeedEvent("lock_acquired", f"node-{i % 2}", "billing" if i % 3 else "reports", f"event {i}",
                        fields={"token": i}) for i in range(7)]  # fmt: skip
    store.append(events[:3])
    store.append(events[3:])
    newest = store.recent(5)
    assert [e.text for e in newest] == ["event 6", "event 5", "event 4", "event 3", "event 2"]
    assert newest[0].fields == {"token": 6} and newest[0].at is not None
    assert [e.text for e in store.recent(10, node="node-1", subject="billing")] == ["event 5", "event 1"]
    assert store.recent(10, kinds=("run_failed",)) == []
    store.max_events = 4
    store.append([FeedEvent("node_joined", "node-9", None, "event 7")])
    assert [e.text for e in store.recent(10)] == ["event 7", "event 6", "event 5", "event 4"]


def test_a_traceback_is_masked_by_the_one_rule_and_bounded() -> None:
    url = "postgresql://cron:pw-Secret-123@db/app"

    try:
        try:
            raise KeyError("x" * 20_000)
        except KeyError as cause:
            raise ConnectionError(f"cannot reach {url} (password pw-Secret-123)") from cause
    except ConnectionError as exc:
        text = traceback_text(exc, url)
    assert "pw-Secret-123" not in text and "postgresql://cron:***@db/app" in text
    assert len(text) <= MAX_DETAIL + 100 and "characters cut" in text
    assert text.startswith("Traceback") and text.rstrip().endswith("(password ***)")


@pytest.mark.sqlite
def test_a_node_keeps_a_failed_run_with_its_traceback_and_its_start_and_stop(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/feed.db"
    sched = MutexScheduler(lock_url=url, unactive_interval=3)

    secret = "hunter" + "22"  # a value at run time: a traceback's source lines never hold it

    def sync_catalog() -> None:
        raise ValueError(f"catalog refused: postgresql://cron:{secret}@db/app?sslmode=require&password={secret}")

    sched.add_job(sync_catalog, "interval", seconds=1, id="sync_catalog", mutex="catalog")
    sched.start()
    reader = lock_store_from_url(url)
    try:
        feed_store = feed_store_for(reader)
        assert feed_store is not None
        assert wait_for(lambda: bool(feed_store.recent(5, kinds=("run_failed",))), 20.0)
        failed = feed_store.recent(5, kinds=("run_failed",))
    finally:
        sched.shutdown()
    kinds = [e.kind for e in feed_store.recent(50)]
    reader.close()
    run = failed[0]
    assert run.subject == "catalog" and run.fields["job"] == "sync_catalog" and run.fields["token"] >= 1
    assert run.detail is not None and "Traceback" in run.detail and "in sync_catalog" in run.detail
    assert "hunter22" not in run.detail and "hunter22" not in run.text
    assert kinds[0] == "node_stopped" and "node_joined" in kinds and "lock_acquired" in kinds and "lock_released" in kinds
