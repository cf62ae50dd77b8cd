"""``mutexcron run``'s graceful stop on SIGTERM/SIGINT.

Python runs a signal's handler in the main thread, and only when that thread next runs Python
code. The kernel may deliver a process's signal to any of its threads (a node has dozens: task
handlers, the heartbeat, the scheduler's loop), and a main thread blocked in a wait (ours, or a
BlockingScheduler's or an asyncio loop's until the next fire time, hours away) is then not woken:
the stop would wait for the next job. So the interpreter's C-level handler also writes to a socket
(``signal.set_wakeup_fd``) from whichever thread took the signal; a relay thread reading it nudges
the main thread out of its wait (the scheduler's ``wakeup()``, and our own event), and the main
thread runs the handler at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import socket
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

#: A second signal later than this after the first exits at once; sooner, it is the same stop
#: delivered twice (to the process and to its process group).
SECOND_SIGNAL_AFTER = 1.0


class GracefulStop:
    """SIGTERM/SIGINT: stop the scheduler gracefully, once; a second signal exits at once.

    The stop runs on a thread of its own, so it works while a BlockingMutexScheduler's
    ``start()`` holds the main thread.
    """

    def __init__(self, sched: Any, shutdown_timeout: float) -> None:
        self.sched = sched
        self.shutdown_timeout = shutdown_timeout
        self.signals: list[tuple[int, float]] = []
        self.signalled = threading.Event()
        self.thread = threading.Thread(target=self._stop, name="mutexcron-stop")
        #: The exit status the command ends with once stopped (``give_up``); 0 after a signal.
        self.exit_code = 0
        self._why = ""
        self._begin_lock = threading.Lock()
        self._nudged = threading.Event()
        self._wake_read, self._wake_write = socket.socketpair()
        for end in (self._wake_read, self._wake_write):
            end.setblocking(False)

    def install(self) -> None:
        """From the main thread: the handlers, the wake-up socket any thread's signal writes to, and
        the relay that nudges the main thread when it does."""
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        signal.set_wakeup_fd(self._wake_write.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._relay, name="mutexcron-signal-relay", daemon=True).start()

    def on_signal(self, signum: int, _frame: Any) -> None:
        now = time.monotonic()
        if self.signals and now - self.signals[0][1] > SECOND_SIGNAL_AFTER:
            log.error("second signal: exiting now without waiting for jobs or releasing locks")
            os._exit(128 + signum)
        if not self.signals:
            self.signals.append((signum, now))
            self._begin(f"{signal.Signals(signum).name} received")

    def give_up(self, exit_code: int) -> None:
        """Stop gracefully, as for a signal, and make the command exit with ``exit_code``."""
        self.exit_code = exit_code
        self._begin("giving up")
        self._poke()

    def wait(self) -> None:
        """Main thread: block until a signal (or ``give_up``) has begun the stop, then until it has finished."""
        while not self.signalled.is_set():
            # The relay sets it on any signal; returning to Python code runs the handler. The
            # timeout is only a backstop.
            self._nudged.wait(5.0)
            self._nudged.clear()
        self.thread.join()
        self._close()

    async def wait_on_loop(self) -> None:
        """The asyncio flavour of ``wait``: the relay wakes the loop (the scheduler's ``wakeup()``),
        so the main thread runs the handler; the stop's end is awaited off the loop."""
        await asyncio.to_thread(self._wait_for_stop)
        self._close()

    def _wait_for_stop(self) -> None:
        self.signalled.wait()
        self.thread.join()

    def _begin(self, why: str) -> None:
        with self._begin_lock:  # a signal and give_up() may race: one stop
            if self.signalled.is_set():
                return
            self._why = why
            self.thread.start()
            self.signalled.set()

    def _stop(self) -> None:
        log.info(
            "%s: stopping (waiting up to %ss for running guarded jobs and task handlers)",
            self._why,
            self.shutdown_timeout,
        )
        self.sched.shutdown(wait=True)

    def _relay(self) -> None:
        """Wait for the wake-up socket; on each write (a signal, or ``give_up``), nudge the main thread."""
        while True:
            try:
                select.select([self._wake_read], [], [])
                if not self._drain():
                    return  # closed
            except (OSError, ValueError):  # closed under us
                return
            self._nudged.set()
            try:
                self.sched.wakeup()  # a BlockingScheduler's wait, an asyncio loop's select: returns now
            except Exception as exc:  # noqa: BLE001 - not started yet, or shut down: nothing to wake
                log.debug("no scheduler loop to wake (%s)", type(exc).__name__)

    def _poke(self) -> None:
        try:
            self._wake_write.send(b"\0")
        except OSError:  # full (a wake-up is pending anyway) or closed
            pass

    def _drain(self) -> bool:
        """Read what is pending; False once the socket is closed."""
        try:
            while True:
                if not self._wake_read.recv(512):
                    return False
        except BlockingIOError:  # all read
            return True

    def _close(self) -> None:
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:  # not the main thread (a caller running the command in a thread)
            pass
        self._wake_write.close()  # the relay reads the end of the stream and returns
