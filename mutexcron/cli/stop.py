"""``mutexcron run``'s graceful stop on SIGTERM/SIGINT.

Python runs a signal's handler in the main thread, and only when that thread next runs Python
code. The kernel may deliver a process's signal to any of its threads (a node has dozens: task
handlers, the heartbeat, the scheduler's loop); a main thread blocked in a plain wait is then never
woken, and the stop never starts. So the main thread waits on a socket that the interpreter's C-level
handler writes to (``signal.set_wakeup_fd``) from whichever thread took the signal: it wakes, runs
the handler, and the stop begins.
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
        self._wake_read, self._wake_write = socket.socketpair()
        for end in (self._wake_read, self._wake_write):
            end.setblocking(False)

    def install(self) -> None:
        """From the main thread: the handlers, and the wake-up socket any thread's signal writes to."""
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        signal.set_wakeup_fd(self._wake_write.fileno(), warn_on_full_buffer=False)

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
            # Wakes on any signal, whichever thread the kernel gave it to; returning to Python
            # code runs the handler. The timeout is only a backstop.
            select.select([self._wake_read], [], [], 5.0)
            self._drain()
        self.thread.join()
        self._close()

    async def wait_on_loop(self) -> None:
        """The asyncio flavour of ``wait``: the loop watches the wake-up socket, so the main thread
        (the loop's) runs the handler; the stop's end is awaited off the loop."""
        loop = asyncio.get_running_loop()
        loop.add_reader(self._wake_read.fileno(), self._drain)
        try:
            await asyncio.to_thread(self._wait_for_stop)
        finally:
            loop.remove_reader(self._wake_read.fileno())
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

    def _poke(self) -> None:
        try:
            self._wake_write.send(b"\0")
        except OSError:  # full (a wake-up is pending anyway) or closed
            pass

    def _drain(self) -> None:
        try:
            while self._wake_read.recv(512):
                pass
        except OSError:  # empty
            pass

    def _close(self) -> None:
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:  # not the main thread (a caller running the command in a thread)
            pass
        self._wake_read.close()
        self._wake_write.close()
