"""Ping hooks for external monitors (healthchecks.io, Cronitor...): ``@sched.mutex(ping=...)``.

For each guarded run, on the node that runs it, a ping when the run starts and one when it ends
(success or fail), so a monitor alerts when a job stops running anywhere, fails, or runs too long.
Two URL forms, told apart by the ``{state}`` placeholder:

* **healthchecks.io** (no ``{state}``): the check's ping URL, ``https://hc-ping.com/<uuid>``;
  mutexcron adds ``/start``, nothing or ``/fail`` to the path and ``?rid=<run id>`` (a UUID per
  run, the same in a run's start and end pings), as healthchecks.io documents.
* **A template with** ``{state}`` (Cronitor's telemetry URL and the like): the whole URL, with
  ``{state}`` replaced by ``run``, ``complete`` or ``fail`` and ``{rid}`` by the run id:
  ``https://cronitor.link/p/<api-key>/{job}?state={state}&series={rid}``.

Both forms may hold ``{job}`` (the job id) and ``{lock}`` (the lock name), URL-encoded.

Pings are sent by one daemon thread per scheduler (started at the first ping) from a bounded
queue: the job's thread only queues them (a full queue drops and counts them), so a slow or
unreachable monitor never delays or fails a job. Each ping has a 5 s timeout and is not retried;
a failing monitor logs one WARNING when pings start failing and one when they are ok again (per
job), with the URL masked (:func:`mutexcron.urls.mask_path`: the path holds the secret).
``shutdown()`` waits up to one timeout for the pings still queued.
"""

from __future__ import annotations

import http.client
import logging
import string
import threading
import time
import urllib.request
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

from apscheduler.events import EVENT_SCHEDULER_SHUTDOWN

from .errors import ConfigurationError
from .events import EVENT_RUN_FINISHED, EVENT_RUN_STARTED, MutexEvent
from .urls import mask_path

__all__ = ["PING_TIMEOUT", "PingSender", "check_ping", "ping_url", "register", "run_id"]

log = logging.getLogger("mutexcron")

#: Seconds a ping may take before it counts as failed.
PING_TIMEOUT = 5.0
#: Pings waiting to be sent, at most; more are dropped (and counted).
QUEUE_SIZE = 1000
#: The placeholders a ping template may hold.
FIELDS = frozenset({"job", "lock", "state", "rid"})
#: What a run's start, success and failure add to a healthchecks.io ping URL's path.
HEALTHCHECKS_SUFFIX = {"start": "/start", "success": "", "fail": "/fail"}
#: The ``{state}`` of a run's start, success and failure (Cronitor's telemetry states).
STATE_WORDS = {"start": "run", "success": "complete", "fail": "fail"}

_RUN_IDS = uuid.UUID("5b0e1c2e-7a43-4b8e-9c56-2f1d8e0a6c31")  # the namespace of run ids
_FIX = (
    "give the monitor's ping URL, e.g. ping='https://hc-ping.com/<uuid>' (healthchecks.io: '/start', '/fail' "
    "and '?rid=' are added), or a URL template with {state}, e.g. "
    "ping='https://cronitor.link/p/<api-key>/{job}?state={state}&series={rid}' (Cronitor)"
)


def _fields(template: str) -> set[str]:
    """The placeholders of ``template``; ValueError if it is malformed or formats one."""
    names = set()
    for _text, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if spec or conversion:
            raise ValueError(f"{{{name}}} takes no format spec or conversion")
        names.add(name)
    return names


def check_ping(ping: object, job: str) -> None:
    """Raise ConfigurationError (naming ``job`` and the fix) unless ``ping`` is an http(s) ping URL
    or template. The message shows the URL masked: its path is a secret."""
    if not isinstance(ping, str):
        problem = f"ping= must be a URL string, not {type(ping).__name__}"
    else:
        shown = mask_path(ping)
        try:
            names = _fields(ping)
            unknown = sorted(names - FIELDS)
            if unknown:
                problem = f"ping={shown!r} has unknown placeholders {unknown} (only {{job}}, {{lock}}, {{state}}, {{rid}})"
            elif "rid" in names and "state" not in names:
                problem = f"ping={shown!r} has {{rid}} without {{state}} (without {{state}}, '?rid=' is added for you)"
            else:
                parts = urlsplit(ping.format(job="job", lock="lock", state="run", rid="rid"))
                if parts.scheme.lower() in ("http", "https") and parts.hostname:
                    return
                problem = f"ping={shown!r} is not an http:// or https:// URL"
        except ValueError as exc:
            problem = f"ping={shown!r} is not a valid URL template ({exc})"
    raise ConfigurationError(f"job {job!r}: {problem}; {_FIX}")


def run_id(event: MutexEvent) -> str:
    """The run's id: a UUID, the same for its start and end events (from lock, job, token and fire time)."""
    fire = event.fire_time.isoformat() if event.fire_time is not None else ""
    return str(uuid.uuid5(_RUN_IDS, f"{event.lock}\0{event.job_id}\0{event.token}\0{fire}"))


def ping_url(template: str, state: str, *, job: str, lock: str, rid: str) -> str:
    """The URL to ping for ``state`` (``start``, ``success`` or ``fail``) of a run."""
    values = {"job": quote(job, safe=""), "lock": quote(lock, safe="")}
    if "state" in _fields(template):
        return template.format(**values, state=STATE_WORDS[state], rid=rid)
    parts = urlsplit(template.format(**values))
    path = parts.path.rstrip("/") + HEALTHCHECKS_SUFFIX[state]
    query = "&".join(q for q in (parts.query, f"rid={rid}") if q)
    return urlunsplit((parts.scheme, parts.netloc, path, query, ""))


def _scrub(text: str, url: str) -> str:
    """An error message with the ping URL's path segments and query values (the secrets) masked."""
    parts = urlsplit(url)
    secrets = {url, parts.path, *parts.path.split("/"), *(v for _k, v in parse_qsl(parts.query))}
    for secret in sorted((s for s in secrets if len(s) >= 6), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


@dataclass(frozen=True)
class _Ping:
    job: str
    url: str
    state: str


class PingSender:
    """The scheduler's listener for run events that sends the pings, from one daemon thread.

    Args:
        template_of: the ping template of a job id (None: the job pings nothing).
        timeout: seconds per ping.
        maxsize: pings that may wait; more are dropped and counted in ``dropped``.

    ``sent``, ``failed`` and ``dropped`` count the pings.
    """

    def __init__(
        self, template_of: Callable[[str], str | None], *, timeout: float = PING_TIMEOUT, maxsize: int = QUEUE_SIZE
    ) -> None:
        self.template_of = template_of
        self.timeout = timeout
        self.maxsize = maxsize
        self.sent = self.failed = self.dropped = 0
        self._cond = threading.Condition()
        self._pending: deque[_Ping] = deque()
        self._busy = False
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._overflowing = False
        self._failing: dict[str, int] = {}  # job id -> pings failed since its last success

    def __call__(self, event: Any) -> None:
        """The listener: queue the run's ping (never blocks); flush at the scheduler's shutdown."""
        if event.code == EVENT_SCHEDULER_SHUTDOWN:
            self.close(self.timeout)
            return
        if not isinstance(event, MutexEvent) or event.job_id is None:
            return
        template = self.template_of(event.job_id)
        if not template:
            return
        if event.code == EVENT_RUN_STARTED:
            state = "start"
        else:
            state = "success" if event.details.get("outcome") == "success" else "fail"
        url = ping_url(template, state, job=event.job_id, lock=event.lock or "", rid=run_id(event))
        self._put(_Ping(event.job_id, url, state))

    def _put(self, ping: _Ping) -> None:
        with self._cond:
            if len(self._pending) >= self.maxsize:
                self.dropped += 1
                if not self._overflowing:
                    self._overflowing = True
                    log.warning("%d pings are waiting to be sent: dropping new ones until they are (the jobs are "
                                "unaffected)", len(self._pending))  # fmt: skip
                return
            self._pending.append(ping)
            self._stopping = False
            if self._thread is None or not self._thread.is_alive():  # first ping, after close(), or a fork
                self._thread = threading.Thread(target=self._serve, name="mutexcron-pings", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                while not self._pending:
                    if self._overflowing:
                        self._overflowing = False
                        log.warning("ping queue drained: %d pings were dropped so far", self.dropped)
                    if self._stopping:
                        self._thread = None
                        return
                    self._cond.wait()
                ping = self._pending.popleft()
                self._busy = True
            self._send(ping)

    def _send(self, ping: _Ping) -> None:
        request = urllib.request.Request(ping.url, headers={"User-Agent": "mutexcron"})  # noqa: S310 (http(s) checked)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310
                response.read(1024)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            self.failed += 1
            failed = self._failing.get(ping.job)
            self._failing[ping.job] = (failed or 0) + 1
            if failed is None:
                log.warning(
                    "job %r: %s ping to %s failed (%s); the job is unaffected, and this is logged again only "
                    "once pings are ok again",
                    ping.job, ping.state, mask_path(ping.url), _scrub(str(exc), ping.url),
                )  # fmt: skip
            return
        self.sent += 1
        failed = self._failing.pop(ping.job, None)
        if failed is not None:
            log.warning("job %r: pings to %s are ok again (%d failed)", ping.job, mask_path(ping.url), failed)

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the queued pings to be sent; True if none is left."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or (self._busy and self._thread is not None):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float) -> None:
        """Send what is queued (up to ``timeout`` seconds) and let the thread end; a later ping starts it again."""
        self.flush(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()


def register(scheduler: Any) -> PingSender:
    """Make the pings a listener of ``scheduler``'s run events (and its shutdown, to flush them).

    Cheap when no job pings: a dictionary look-up per run, and no thread."""

    def template_of(job_id: str) -> str | None:
        guard = scheduler._guarded.get(job_id)
        return None if guard is None else guard.config.ping

    sender = PingSender(template_of)
    scheduler.add_listener(sender, EVENT_RUN_STARTED | EVENT_RUN_FINISHED | EVENT_SCHEDULER_SHUTDOWN)
    return sender
