"""Lease and run events, delivered through APScheduler's own listeners.

``sched.add_listener(callback, EVENT_LOCK_LOST | EVENT_RUN_MISSED)`` gets a :class:`MutexEvent`
for each. The codes are bit flags above APScheduler's own (``EVENT_ALL`` does not include them:
use :data:`EVENT_MUTEX_ALL`). mutexcron's own state-change log lines are a listener of these
events (:func:`log_event`), so a log line and an event never disagree.

Listeners run on the thread that emits the event (the heartbeat thread for lease events, a job's
thread for run events), as APScheduler's do: keep them quick.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from apscheduler.events import SchedulerEvent

from .names import printable

__all__ = [
    "EVENT_CAUGHT_UP",
    "EVENT_LOCK_ACQUIRED",
    "EVENT_LOCK_LOST",
    "EVENT_LOCK_PAUSED",
    "EVENT_LOCK_RELEASED",
    "EVENT_LOCK_RESUMED",
    "EVENT_LOCK_TAKEN_OVER",
    "EVENT_MUTEX_ALL",
    "EVENT_RUN_FINISHED",
    "EVENT_RUN_MISSED",
    "EVENT_RUN_SKIPPED",
    "EVENT_RUN_STARTED",
    "EVENT_STORE_DOWN",
    "EVENT_STORE_UP",
    "EVENT_TASK_FAILED",
    "Emit",
    "MutexEvent",
    "log_event",
]

log = logging.getLogger("mutexcron")

#: This node became the holder of a lock that was free, released or its own (``moved``: why
#: placement moved it here, when it did: a node joined, left, its lease ran out, or rebalanced).
EVENT_LOCK_ACQUIRED = 2**17
#: This node no longer holds a lock (another node holds it, or no renewal succeeded within the lease).
EVENT_LOCK_LOST = 2**18
#: This node took a lock over from another node whose lease ran out (``previous_holder``, ``stale_for``).
EVENT_LOCK_TAKEN_OVER = 2**19
#: This node released a lock (graceful stop).
EVENT_LOCK_RELEASED = 2**20
#: A fire time missed during a failover is run now (``fire_time``).
EVENT_CAUGHT_UP = 2**21
#: The store cannot be reached (``error``); nothing guarded runs until it is back.
EVENT_STORE_DOWN = 2**22
#: The store answers again (and the first time it answers).
EVENT_STORE_UP = 2**23
#: A fire time was not run here (``reason``: ``already-run`` elsewhere, ``not-holder``, ``paused``,
#: ``lease-expired`` before the first line, ``stopping``).
EVENT_RUN_SKIPPED = 2**24
#: A fire time older than its misfire grace time was claimed by no node (``fire_time``).
EVENT_RUN_MISSED = 2**25
#: This node saw a lock paused (``mutexcron pause``; ``paused_by``): its fire times are skipped.
EVENT_LOCK_PAUSED = 2**26
#: This node saw a paused lock resumed (``catch_up``: ``mutexcron resume --catch-up``; ``paused_by``: who resumed it).
EVENT_LOCK_RESUMED = 2**27
#: A guarded run starts under its lease (``lag``: seconds from the fire time to the first line).
EVENT_RUN_STARTED = 2**28
#: A guarded run ended (``outcome``: ``success`` or ``error``; ``duration``; ``error``; ``exception``: the job's).
EVENT_RUN_FINISHED = 2**29
#: A task's attempt failed (``task_code``, ``key``, ``attempt``; ``final``: no attempt left, the task
#: failed for good; ``exception``; ``duration``: seconds in the handler). Not logged here: the task
#: worker logs it with its traceback.
EVENT_TASK_FAILED = 2**30

#: Every mutexcron event code.
EVENT_MUTEX_ALL = (
    EVENT_LOCK_ACQUIRED
    | EVENT_LOCK_LOST
    | EVENT_LOCK_TAKEN_OVER
    | EVENT_LOCK_RELEASED
    | EVENT_CAUGHT_UP
    | EVENT_STORE_DOWN
    | EVENT_STORE_UP
    | EVENT_RUN_SKIPPED
    | EVENT_RUN_MISSED
    | EVENT_LOCK_PAUSED
    | EVENT_LOCK_RESUMED
    | EVENT_RUN_STARTED
    | EVENT_RUN_FINISHED
    | EVENT_TASK_FAILED
)

NAMES = {
    EVENT_LOCK_ACQUIRED: "lock_acquired",
    EVENT_LOCK_LOST: "lock_lost",
    EVENT_LOCK_TAKEN_OVER: "lock_taken_over",
    EVENT_LOCK_RELEASED: "lock_released",
    EVENT_CAUGHT_UP: "caught_up",
    EVENT_STORE_DOWN: "store_down",
    EVENT_STORE_UP: "store_up",
    EVENT_RUN_SKIPPED: "run_skipped",
    EVENT_RUN_MISSED: "run_missed",
    EVENT_LOCK_PAUSED: "lock_paused",
    EVENT_LOCK_RESUMED: "lock_resumed",
    EVENT_RUN_STARTED: "run_started",
    EVENT_RUN_FINISHED: "run_finished",
    EVENT_TASK_FAILED: "task_failed",
}


class MutexEvent(SchedulerEvent):  # type: ignore[misc]
    """A lease or run event.

    Attributes:
        code: one of the ``EVENT_*`` codes.
        name: the code's name (``"lock_lost"``...).
        lock: the lock's name (None for store events).
        job_id: the job concerned, if any.
        node: this node's id.
        token: the fencing token concerned, if any.
        fire_time: the fire time concerned, if any (aware UTC).
        details: what else the event says (``previous_holder``, ``stale_for``, ``reason``,
            ``outcome``, ``duration``, ``lag``, ``error``, ``store``, ``what``...); also
            readable as attributes (``event.reason``).
    """

    def __init__(
        self,
        code: int,
        *,
        lock: str | None = None,
        job_id: str | None = None,
        node: str | None = None,
        token: int | None = None,
        fire_time: datetime | None = None,
        **details: Any,
    ) -> None:
        super().__init__(code)
        self.name = NAMES.get(code, str(code))
        self.lock, self.job_id, self.node, self.token, self.fire_time = lock, job_id, node, token, fire_time
        self.details = details

    def __getattr__(self, name: str) -> Any:
        details = self.__dict__.get("details", {})
        if name in details:
            return details[name]
        raise AttributeError(name)

    def __repr__(self) -> str:
        fields = {"lock": self.lock, "job_id": self.job_id, "token": self.token, **self.details}
        shown = ", ".join(f"{k}={v!r}" for k, v in fields.items() if v is not None)
        return f"<MutexEvent {self.name} {shown}>"


#: What emits events: a callable taking one :class:`MutexEvent`.
Emit = Callable[[MutexEvent], None]


def log_event(event: MutexEvent) -> None:
    """mutexcron's state-change log lines, written from the events (one per change of state)."""
    writer = _WRITERS.get(event.code)
    if writer is not None:
        writer(event)


def _acquired(e: MutexEvent) -> None:
    reason = e.details.get("reason")
    moved = e.details.get("moved")
    log.info("acquired lock %r (token %d)%s%s", e.lock, e.token, f" ({reason})" if reason else "",
             f"; placement moved it here: {moved}" if moved else "")  # fmt: skip


def _taken_over(e: MutexEvent) -> None:
    log.warning(
        "took over lock %r (token %d) from %s (%s), whose heartbeat was %.1fs old",
        e.lock,
        e.token,
        e.details.get("previous_holder"),
        e.details.get("previous_ip"),
        e.details.get("stale_for") or 0.0,
    )


def _lost(e: MutexEvent) -> None:
    log.warning("lost lock %r (token %d): %s", e.lock, e.token, e.details.get("reason"))


def _released(e: MutexEvent) -> None:
    successor, reason = e.details.get("successor"), e.details.get("reason")
    to = f" to {successor}" if successor else ""
    log.info("released lock %r (token %d)%s%s", e.lock, e.token, to, f" ({reason})" if reason else "")


def _caught_up(e: MutexEvent) -> None:
    log.warning("job %r: catching up fire time %s missed during the failover of lock %r", e.job_id, e.fire_time, e.lock)


def _store_down(e: MutexEvent) -> None:
    log.error(
        "%s store %s is unreachable: %s will not run until it is back; retrying (%s)",
        e.details.get("what", "lock"),
        e.details.get("store"),
        _work(e),
        e.details.get("error"),
    )


def _store_up(e: MutexEvent) -> None:
    if e.details.get("first"):
        log.info("%s store %s is reachable (node %s)", e.details.get("what", "lock"), e.details.get("store"), e.node)
    else:
        log.warning("%s store %s is reachable again; %s resume", e.details.get("what", "lock"), e.details.get("store"), _work(e))


def _work(e: MutexEvent) -> str:
    return "guarded jobs" if e.details.get("what", "lock") == "lock" else "tasks"


def _skipped(e: MutexEvent) -> None:
    reason = e.details.get("reason")
    claimed = e.details.get("claimed")
    if reason == "already-run" and claimed is not None and e.fire_time is not None and claimed > e.fire_time:
        log.info("job %r: fire time %s not run: the later fire time %s is claimed under lock %r (claims only go forward)",
                 e.job_id, e.fire_time, claimed, e.lock)  # fmt: skip
    elif reason == "already-run":
        log.info("job %r: fire time %s already ran under lock %r; not running it again", e.job_id, e.fire_time, e.lock)
    elif reason == "lease-expired":
        log.warning(
            "job %r: lease of lock %r (token %d) ran out before the run could start; not run", e.job_id, e.lock, e.token
        )
    elif reason == "stopping":
        log.info("job %r not started: the scheduler is stopping", e.job_id)


def _missed(e: MutexEvent) -> None:
    log.error(
        "job %r: fire time %s of lock %r ran on no node (older than its misfire grace time with no claim): "
        "every node was down or skipped it",
        e.job_id,
        e.fire_time,
        e.lock,
    )


def _paused(e: MutexEvent) -> None:
    log.warning(
        "lock %r is paused (by %s): its guarded jobs are skipped on every node until `mutexcron resume %s`",
        e.lock,
        printable(e.details.get("paused_by")),  # an operator's text: escaped, never a forged line
        printable(e.lock),
    )


def _resumed(e: MutexEvent) -> None:
    catch_up = "; its jobs run once now to catch up (trigger requests)" if e.details.get("catch_up") else ""
    log.warning("lock %r is resumed%s", e.lock, catch_up)


_WRITERS: dict[int, Callable[[MutexEvent], None]] = {
    EVENT_LOCK_ACQUIRED: _acquired,
    EVENT_LOCK_TAKEN_OVER: _taken_over,
    EVENT_LOCK_LOST: _lost,
    EVENT_LOCK_RELEASED: _released,
    EVENT_CAUGHT_UP: _caught_up,
    EVENT_STORE_DOWN: _store_down,
    EVENT_STORE_UP: _store_up,
    EVENT_RUN_SKIPPED: _skipped,
    EVENT_RUN_MISSED: _missed,
    EVENT_LOCK_PAUSED: _paused,
    EVENT_LOCK_RESUMED: _resumed,
}
