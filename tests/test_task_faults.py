"""The task pool under faults (issue 31): worker rules checked on every task store.

Each test runs a real :class:`TaskWorker` on the contract suite's stores (tests/test_task_store.py's
``tasks_ctx``: every backend), with this node's monotonic clock injected so a lease runs out by the
node's clock without sleeping, while the store's lease (long) still holds: what a node sees after
a stall that nobody else used to take its task.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from mutexcron.tasks import TaskStore
from mutexcron.tasks.handlers import Handler, Task
from mutexcron.tasks.worker import TaskWorker
from tests import test_task_store
from tests.backends import FakeClock, backend_params
from tests.test_task_cluster import NOW, TaskCluster, cluster
from tests.test_task_store import TASK_BACKENDS, TaskCtx
from tests.test_task_worker import wait_for as wait_until

tasks_ctx = test_task_store.tasks_ctx  # the contract suite's fixture: a store of its own per test
__all__ = ["cluster", "tasks_ctx"]  # fixtures shared with the contract suite and the task cluster tests

every_backend = pytest.mark.parametrize("kind", backend_params(*TASK_BACKENDS))
NODE = "n1:1:aaaa"
SOON = timedelta(seconds=-1)
LEASE = 30.0  # the store's lease outlives the test: only the node's clock runs it out


def wait_for(condition: Callable[[], bool], timeout: float = 15.0) -> bool:
    return wait_until(condition, timeout)


class Workers:
    """Workers on one store with one injected monotonic clock, stopped at the end."""

    def __init__(self, store: TaskStore) -> None:
        self.store, self.clock, self.made = store, FakeClock(), []  # type: list[TaskWorker]

    def start(self, *handlers: Handler, **options: Any) -> TaskWorker:
        worker = TaskWorker(self.store, {h.code: h for h in handlers}, NODE, clock=self.clock, backstop=0.05, **options)
        self.made.append(worker)
        worker.start()
        return worker


@pytest.fixture
def workers(tasks_ctx: TaskCtx) -> Iterator[Workers]:
    made = Workers(tasks_ctx.make())
    yield made
    for worker in made.made:
        worker.stop(2)


class Stepper:
    """A handler in steps: ``look`` lets it read ``task.lost`` once (and stop if set), ``finish`` lets it return."""

    def __init__(self) -> None:
        self.started, self.looked = threading.Event(), threading.Event()
        self.look, self.finish = threading.Event(), threading.Event()
        self.saw: list[bool] = []
        self.tokens: list[int] = []

    def __call__(self, task: Task) -> None:
        self.tokens.append(task.token)
        self.started.set()
        if len(self.tokens) > 1:  # the run after the hand-back: to its end
            return None
        self.look.wait(10)
        self.saw.append(task.lost)  # the documented pattern: stop when lost...
        self.looked.set()
        self.finish.wait(10)  # ...after some clean-up, during which a late renewal lands
        return None


# -- S1: lost is sticky ------------------------------------------------------------------------------
@every_backend
@pytest.mark.parametrize("first", ["handler looks", "renewal lands"])
def test_a_run_whose_lease_ran_out_records_nothing_even_after_a_late_renewal(workers: Workers, first: str) -> None:
    store, handler = workers.store, Stepper()
    store.add("c", "k", SOON)
    worker = workers.start(Handler("c", handler, lease=LEASE))
    assert handler.started.wait(10)
    [claimed] = handler.tokens
    workers.clock.advance(LEASE + 1)  # the node stalled past its lease by its own clock; nobody took the task
    if first == "renewal lands":
        worker.renew_round()  # the store renews it (still this node's): the run must stay lost
    handler.look.set()
    assert handler.looked.wait(10)
    worker.renew_round()  # a renewal after the handler saw lost: the store takes it, the run stays lost
    handler.finish.set()
    assert handler.saw == [True]
    assert wait_for(lambda: len(handler.tokens) == 2)  # handed back, fenced, and run again to its end
    assert handler.tokens[1] > claimed
    assert wait_for(lambda: worker.stats.done == 1)
    assert worker.stats.released == 1 and store.get("c", "k") is None


# -- the same rules on real `mutexcron run` nodes --------------------------------------------------
@pytest.mark.cluster
@pytest.mark.parametrize("kind", backend_params("sqlite", "postgresql", "mysql", "redis"))
def test_a_node_frozen_mid_handler_never_records_the_half_done_run(kind: str, cluster: Callable[..., TaskCluster]) -> None:
    """S1: lease 1.5 s, SIGSTOP 2.5 s in a 15-step handler that cleans up 0.3 s after it sees lost.

    The stalled run stops half-way; whatever renewal lands afterwards, it is handed back (or, if
    the node claimed the task again meanwhile, its hand-back is refused), never recorded as done:
    the task only goes once a run reached its last step.
    """
    c = cluster(kind, lease=1.5, concurrency=2)
    c.start("n0")
    c.pool.add("work", "steps", NOW, {"steps": 15, "step": 0.2, "cleanup": 0.3})
    first = c.wait_event(lambda e: e["key"] == "steps" and e["event"] == "start", 10)
    time.sleep(0.5)
    c.signal("n0", signal.SIGSTOP)
    time.sleep(2.5)
    c.signal("n0", signal.SIGCONT)
    c.wait_event(lambda e: e["event"] == "lost" and e["token"] == first["token"], 10)
    assert wait_for(lambda: c.pool.get("work", "steps") is None, 30), c.output("n0")[-3000:]
    ends = [e for e in c.events() if e["key"] == "steps" and e["event"] == "end"]
    assert ends and all(e["token"] > first["token"] for e in ends), c.events()  # done only by a run that finished
