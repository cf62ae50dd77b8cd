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

Pings are sent by one daemon thread per monitor (scheme, host and port; started at its first
ping) from a bounded queue of its own: the job's thread only queues them (a full queue drops and
counts them), so a slow or unreachable monitor never delays or fails a job, nor another monitor's
pings. Each ping has 5 s for the whole request (connect, send, answer, redirects; a monitor that
trickles its answer is cut off then) and is not retried; a user-info part of the URL is sent as
Basic authentication. A failing monitor logs one WARNING when pings start failing and one when
they are ok again (per job), with the URL masked and the error redacted
(:func:`mutexcron.urls.mask_path`, :func:`mutexcron.urls.redact`: the path holds the secret).
``shutdown()`` waits up to one timeout for the pings still queued.
"""

from __future__ import annotations

import base64
import http.client
import logging
import string
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urljoin, urlsplit, urlunsplit

from apscheduler.events import EVENT_SCHEDULER_SHUTDOWN

from ..errors import ConfigurationError
from ..events import EVENT_RUN_FINISHED, EVENT_RUN_STARTED, MutexEvent
from ..urls import mask_path, redact, split_userinfo
from .socket_deadlines import SOCKET_DEADLINES

__all__ = ["PING_TIMEOUT", "PingSender", "check_ping", "ping_url", "register", "run_id", "send_ping"]

log = logging.getLogger("mutexcron")

#: Seconds a ping may take, for the whole request, before it counts as failed.
PING_TIMEOUT = 5.0
#: Pings waiting to be sent to one monitor, at most; more are dropped (and counted).
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


@dataclass(frozen=True)
class _Ping:
    job: str
    url: str
    state: str


class _RequestFailed(OSError):
    """A ping's HTTP answer that is not a success, or one past its deadline."""


#: Redirects a ping follows (within its deadline), as urllib did.
MAX_REDIRECTS = 3


def send_ping(url: str, timeout: float) -> int:
    """GET ``url`` within ``timeout`` seconds for the whole request (connect, send, answer,
    redirects); return the HTTP status. A user-info part is sent as Basic authentication, never
    in the request line. Raises OSError (timeouts and HTTP errors included), ValueError or
    :class:`http.client.HTTPException`.

    Name resolution is the one step the deadline cannot cut short (the resolver's own timeouts apply).
    """
    deadline = time.monotonic() + timeout
    for _ in range(MAX_REDIRECTS + 1):
        status, location = _get_once(url, deadline, timeout)
        if location is None:
            return status
        url = urljoin(url, location)
    raise _RequestFailed(f"more than {MAX_REDIRECTS} redirects")


def _get_once(url: str, deadline: float, timeout: float) -> tuple[int, str | None]:
    bare, user, password = split_userinfo(url)  # the URL's own rule: a password may hold "/" or "@"
    parts = urlsplit(bare)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("not an http:// or https:// URL")
    headers = {"User-Agent": "mutexcron", "Connection": "close"}
    if user is not None:
        pair = f"{user}:{password or ''}"
        headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"timed out after {timeout:g}s (the whole request)")
    kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    conn = kind(host, parts.port, timeout=left)
    key = None
    try:
        conn.connect()
        key = SOCKET_DEADLINES.watch(conn.sock, deadline)
        conn.request("GET", urlunsplit(("", "", parts.path or "/", parts.query, "")), headers=headers)
        response = conn.getresponse()
        response.read(1024)
    except (OSError, http.client.HTTPException) as exc:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g}s (the whole request)") from exc
        raise
    finally:
        cut = key is not None and SOCKET_DEADLINES.unwatch(key)
        conn.close()
    if cut:  # a shut-down socket can read as a short, complete-looking answer
        raise TimeoutError(f"timed out after {timeout:g}s (the whole request)")
    location = response.getheader("Location")
    if response.status in (301, 302, 303, 307, 308) and location:
        return response.status, location
    if response.status >= 400:
        raise _RequestFailed(f"HTTP Error {response.status}: {response.reason}")
    return response.status, None


class _Monitor:
    """The pings to one monitor (scheme and host): a queue of their own and a daemon thread of
    their own, so a slow or unreachable monitor delays no other monitor's pings."""

    def __init__(self, sender: PingSender, name: str) -> None:
        self.sender = sender
        self.name = name
        self.pending: deque[_Ping] = deque()
        self.busy = False
        self.thread: threading.Thread | None = None
        self.overflowing = False

    def start(self) -> None:
        if self.thread is None or not self.thread.is_alive():  # first ping, after close(), or a fork
            self.thread = threading.Thread(target=self.serve, name=f"mutexcron-pings {self.name}", daemon=True)
            self.thread.start()

    def serve(self) -> None:
        cond = self.sender._cond
        while True:
            with cond:
                self.busy = False
                cond.notify_all()
                while not self.pending:
                    if self.overflowing:
                        self.overflowing = False
                        log.warning("ping queue of %s drained: %d pings were dropped so far", self.name, self.sender.dropped)
                    if self.sender._stopping:
                        self.thread = None
                        return
                    cond.wait()
                ping = self.pending.popleft()
                self.busy = True
            self.sender._send(ping)


class PingSender:
    """The scheduler's listener for run events that sends the pings, one daemon thread per monitor.

    Args:
        template_of: the ping template of a job id (None: the job pings nothing).
        timeout: seconds per ping, for the whole request.
        maxsize: pings that may wait per monitor; more are dropped and counted in ``dropped``.

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
        self._monitors: dict[str, _Monitor] = {}  # scheme://host:port -> its queue and thread
        self._stopping = False
        self._failing: dict[str, int] = {}  # job id -> pings failed since its last success

    @property
    def threads(self) -> list[threading.Thread]:
        """The sender threads running now (one per monitor with pings to send)."""
        with self._cond:
            return [m.thread for m in self._monitors.values() if m.thread is not None and m.thread.is_alive()]

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
        parts = urlsplit(split_userinfo(ping.url)[0])
        name = f"{parts.scheme.lower()}://{parts.netloc.lower()}"  # the monitor (scheme, host, port)
        with self._cond:
            monitor = self._monitors.get(name)
            if monitor is None:
                monitor = self._monitors[name] = _Monitor(self, name)
            if len(monitor.pending) >= self.maxsize:
                self.dropped += 1
                if not monitor.overflowing:
                    monitor.overflowing = True
                    log.warning("%d pings to %s are waiting to be sent: dropping new ones until they are (the jobs "
                                "are unaffected)", len(monitor.pending), name)  # fmt: skip
                return
            monitor.pending.append(ping)
            self._stopping = False
            monitor.start()
            self._cond.notify_all()

    def _send(self, ping: _Ping) -> None:
        try:
            send_ping(ping.url, self.timeout)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            with self._cond:
                self.failed += 1
                failed = self._failing.get(ping.job)
                self._failing[ping.job] = (failed or 0) + 1
            if failed is None:
                log.warning(
                    "job %r: %s ping to %s failed (%s); the job is unaffected, and this is logged again only "
                    "once pings are ok again",
                    ping.job, ping.state, mask_path(ping.url), redact(str(exc) or type(exc).__name__, ping.url, path=True),
                )  # fmt: skip
            return
        with self._cond:
            self.sent += 1
            failed = self._failing.pop(ping.job, None)
        if failed is not None:
            log.warning("job %r: pings to %s are ok again (%d failed)", ping.job, mask_path(ping.url), failed)

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the queued pings to be sent; True if none is left."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(m.pending or (m.busy and m.thread is not None) for m in self._monitors.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float) -> None:
        """Send what is queued (up to ``timeout`` seconds) and let the threads end; a later ping starts them again."""
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
