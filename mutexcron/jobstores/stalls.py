"""Store errors met by APScheduler's loop on a shared job store: said once, and never fatal.

APScheduler's loop dies of an error raised by ``update_job``, ``remove_job`` or
``get_next_run_time``. A shared store keeps it alive: an advance that could not be written (a
lock wait that timed out behind a writer frozen in its transaction, a store outage) is kept here
and written again at the next passes, while the job is held back from the loop (its fire time
already ran, and stays claimed), so one stalled job costs the loop one bounded wait per pass.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..urls import redact

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PendingAdvance:
    """The loop's write of a job's next run time that the store refused with an error."""

    base: bytes  # the state it was read with (the write is made only over it)
    state: bytes  # the state to write
    ts: float | None  # its next run time


class LoopErrors:
    """The loop's store errors of one shared store, by job (or read): one WARNING when one starts
    failing, one when it works again; and the advances left to write."""

    def __init__(self, where: Callable[[], str]) -> None:
        self._where = where
        self._failing: set[str] = set()
        self._lock = threading.Lock()
        self.pending: dict[str, PendingAdvance] = {}

    def failed(self, key: str, what: str, exc: BaseException) -> None:
        with self._lock:
            if key in self._failing:
                return
            self._failing.add(key)
        first = (str(exc).splitlines() or [""])[0]
        log.warning("%s in %s (%s): the scheduler loop carries on and tries again at its next passes",
                    what, self._where(), redact(f"{type(exc).__name__}: {first}"))  # fmt: skip

    def ok(self, key: str) -> None:
        with self._lock:
            if key not in self._failing:
                return
            self._failing.discard(key)
        log.warning("%s: %s written again", self._where(), key)
