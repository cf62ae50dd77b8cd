"""A node's writer of the event feed: a listener of :mod:`mutexcron.events` (and of APScheduler's
start and shutdown) that turns the events a user cares about into :class:`~.FeedEvent`\\ s and
appends them from its own thread.

Listeners run on the thread that emits (the heartbeat thread, a job's thread): this one only
queues, in a bounded buffer. Its thread appends at most every :data:`FLUSH_EVERY` seconds; a store
error keeps the buffer for the next try (the oldest events go once it is full), said once in the
log and once when the feed is written again. At shutdown the "node stopped" event is written
within :data:`STOP_WAIT` seconds, or left.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

from apscheduler.events import EVENT_SCHEDULER_SHUTDOWN, EVENT_SCHEDULER_START

from ... import events as ev
from ...errors import MutexcronError
from ...urls import redact
from . import MAX_DETAIL, FeedEvent, FeedStore, feed_store_for

__all__ = ["FLUSH_EVERY", "FeedWriter", "start_feed", "traceback_text"]

log = logging.getLogger(__name__)

#: Seconds between two appends (a burst of events is one store call).
FLUSH_EVERY = 1.0
#: Events buffered at most while the store cannot be written (the oldest go first).
BUFFERED = 1_000
#: Seconds the "node stopped" event may take to be written at shutdown.
STOP_WAIT = 2.0
#: The events the feed keeps.
WATCHED = (ev.EVENT_LOCK_ACQUIRED | ev.EVENT_LOCK_LOST | ev.EVENT_LOCK_TAKEN_OVER | ev.EVENT_LOCK_RELEASED | ev.EVENT_LOCK_PAUSED
           | ev.EVENT_LOCK_RESUMED | ev.EVENT_RUN_FINISHED | ev.EVENT_RUN_MISSED | ev.EVENT_TASK_FAILED | EVENT_SCHEDULER_START
           | EVENT_SCHEDULER_SHUTDOWN)  # fmt: skip


def traceback_text(exc: BaseException, url: str | None) -> str:
    """``exc``'s traceback, its secrets masked by mutexcron's one rule (:func:`mutexcron.urls.redact`,
    with the store URL's), cut to :data:`MAX_DETAIL` characters: its head and its innermost frames."""
    text = redact("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), url)
    if len(text) <= MAX_DETAIL:
        return text
    head = MAX_DETAIL // 4
    return f"{text[:head]}\n... {len(text) - MAX_DETAIL} characters cut ...\n{text[-(MAX_DETAIL - head):]}"


def start_feed(scheduler: Any, lock_store: Any, node_id: str) -> FeedWriter | None:
    """Listen to ``scheduler``'s events and write them to the feed beside ``lock_store``; None for
    a store that keeps no feed."""
    try:
        store = feed_store_for(lock_store)
    except Exception:
        log.warning("the event feed of %s cannot be opened: no event is kept", lock_store.masked_url, exc_info=True)
        return None
    if store is None:
        return None
    writer = FeedWriter(store, node_id, lock_store.url)
    scheduler.add_listener(writer, WATCHED)
    writer.detach = lambda: scheduler.remove_listener(writer)
    return writer


class FeedWriter:
    """Buffers a node's events and appends them to ``store`` from its own thread."""

    def __init__(self, store: FeedStore, node_id: str, url: str | None = None) -> None:
        self.store = store
        self.node_id = node_id
        self.url = url
        self._buffer: deque[FeedEvent] = deque(maxlen=BUFFERED)
        self._wake = threading.Condition()
        self._stopped = False
        self._failing = False
        #: Removes this writer from its scheduler's listeners (a scheduler started again gets a new one).
        self.detach: Callable[[], None] = lambda: None
        self._thread = threading.Thread(target=self._loop, name="mutexcron-feed", daemon=True)
        self._thread.start()

    # -- the listener: quick, on the emitting thread ------------------------------------------
    def __call__(self, event: Any) -> None:
        try:
            made = self.feed_event(event)
        except Exception:
            log.debug("event %r not kept in the feed", event, exc_info=True)
            return
        if made is None:
            return
        with self._wake:
            self._buffer.append(made)
        if event.code == EVENT_SCHEDULER_SHUTDOWN:
            self.detach()
            self.stop()

    def feed_event(self, event: Any) -> FeedEvent | None:
        """The feed's event for ``event``, or None for one it does not keep (a run that succeeded)."""
        if event.code == EVENT_SCHEDULER_START:
            return FeedEvent("node_joined", self.node_id, None, f"node {self.node_id} joined")
        if event.code == EVENT_SCHEDULER_SHUTDOWN:
            return FeedEvent("node_stopped", self.node_id, None, f"node {self.node_id} stopped cleanly")
        if not isinstance(event, ev.MutexEvent):
            return None
        maker = _MAKERS.get(event.code)
        made = None if maker is None else maker(self, event)
        return dataclasses.replace(made, node=self.node_id) if made is not None and made.node is None else made

    # -- the thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stopped, timeout=FLUSH_EVERY)
                stopped = self._stopped
            self.flush()
            if stopped:
                return

    def flush(self) -> None:
        """Append what is buffered; on a store error keep it for the next try (said once)."""
        with self._wake:
            batch = list(self._buffer)
        if not batch:
            return
        try:
            self.store.append(batch)
        except (MutexcronError, NotImplementedError) as exc:
            if not self._failing:
                log.warning("the event feed cannot be written (%s): events are kept here and written when it can be", exc)
            self._failing = True
            return
        except Exception:
            log.exception("the event feed cannot be written: %d events dropped", len(batch))
        with self._wake:
            for _ in batch:
                if self._buffer:
                    self._buffer.popleft()
        if self._failing:
            log.info("the event feed is written again")
            self._failing = False

    def stop(self) -> None:
        """Write what is buffered (within :data:`STOP_WAIT`), then end the thread."""
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(STOP_WAIT)


def _acquired(w: FeedWriter, e: ev.MutexEvent) -> FeedEvent:
    text = f"{e.node} acquired lock {e.lock} (token {e.token})"
    return FeedEvent("lock_acquired", e.node, e.lock, text, fields={"token": e.token})


def _taken_over(w: FeedWriter, e: ev.MutexEvent) -> FeedEvent:
    old, age = e.details.get("previous_holder"), float(e.details.get("stale_for") or 0.0)
    return FeedEvent("lock_taken_over", e.node, e.lock,
                     f"{e.node} took over lock {e.lock} (token {e.token}) from {old}, whose heartbeat was {age:.1f}s old",
                     fields={"token": e.token, "previous_holder": old, "stale_for": age})  # fmt: skip


def _lost(w: FeedWriter, e: ev.MutexEvent) -> FeedEvent:
    text = f"{e.node} let go of lock {e.lock} (token {e.token}): {e.details.get('reason')}"
    return FeedEvent("lock_lost", e.node, e.lock, text, fields={"token": e.token})


def _released(w: FeedWriter, e: ev.MutexEvent) -> FeedEvent:
    text = f"{e.node} released lock {e.lock} (token {e.token})"
    return FeedEvent("lock_released", e.node, e.lock, text, fields={"token": e.token})


def _paused(w: FeedWriter, e: ev.MutexEvent) -> FeedEvent:
    by = e.details.get("paused_by")
    return FeedEvent("lock_paused", e.node, e.lock, f"lock {e.lock} paused by {by or '?'}", fields={"by": by})


def _resumed(w: FeedWriter, e: ev.MutexEvent) -> FeedEvent:
    by = e.details.get("paused_by")
    catch_up = " with catch-up" if e.details.get("catch_up") else ""
    return FeedEvent("lock_resumed", e.node, e.lock, f"lock {e.lock} resumed{catch_up} by {by or '?'}", fields={"by": by})


def _finished(w: FeedWriter, e: ev.MutexEvent) -> FeedEvent | None:
    if e.details.get("outcome") != "error":
        return None
    exc = e.details.get("exception")
    detail = traceback_text(exc, w.url) if isinstance(exc, BaseException) else None
    error = redact(str(e.details.get("error")), w.url)
    return FeedEvent("run_failed", e.node, e.lock, f"job {e.job_id} failed on {e.node}: {error}", detail,
                     {"job": e.job_id, "token": e.token, "fire_time": e.fire_time, "error": error})  # fmt: skip


def _missed(w: FeedWriter, e: ev.MutexEvent) -> FeedEvent:
    text = f"job {e.job_id}: fire time {e.fire_time:%Y-%m-%d %H:%M:%S} UTC ran on no node"
    return FeedEvent("run_missed", e.node, e.lock, text, fields={"job": e.job_id, "fire_time": e.fire_time})


def _task_failed(w: FeedWriter, e: ev.MutexEvent) -> FeedEvent:
    exc = e.details.get("exception")
    code, key, attempt = e.details.get("task_code"), e.details.get("key"), e.details.get("attempt")
    final = bool(e.details.get("final"))
    error = redact(f"{type(exc).__name__}: {exc}", w.url) if isinstance(exc, BaseException) else "?"
    what = "failed for good" if final else "failed, to be retried"
    return FeedEvent("task_failed" if final else "task_attempt_failed", e.node, code,
                     f"task {code}/{key} attempt {attempt} {what} on {e.node}: {error}",
                     traceback_text(exc, w.url) if isinstance(exc, BaseException) else None,
                     {"key": key, "attempt": attempt, "token": e.token, "error": error,
                      "duration": e.details.get("duration")})  # fmt: skip


_MAKERS = {
    ev.EVENT_LOCK_ACQUIRED: _acquired,
    ev.EVENT_LOCK_TAKEN_OVER: _taken_over,
    ev.EVENT_LOCK_LOST: _lost,
    ev.EVENT_LOCK_RELEASED: _released,
    ev.EVENT_LOCK_PAUSED: _paused,
    ev.EVENT_LOCK_RESUMED: _resumed,
    ev.EVENT_RUN_FINISHED: _finished,
    ev.EVENT_RUN_MISSED: _missed,
    ev.EVENT_TASK_FAILED: _task_failed,
}
