"""The dashboard as a WSGI application (standard library only), mountable in any WSGI server or
framework; :meth:`Dashboard.asgi` is the same app for an ASGI one.

Routes, under wherever it is mounted (``SCRIPT_NAME``):

* ``GET /``, ``/locks``, ``/lock``, ``/shared``, ``/tasks``, ``/history``, ``/task``: the pages (:data:`views.PAGES`);
* ``GET /api/sections/<page>``: the page's sections, refreshed in place by the page's script;
* ``GET /api/status``: the snapshot as JSON (the shape of ``mutexcron status --json``);
* ``GET /api/trigger``: a trigger request's outcome (a read);
* ``POST /api/actions/<action>``: token (checks the token, changes nothing), pause, resume, trigger,
  job_pause, job_resume, job_reschedule, job_remove, retry, cancel, bulk (see :mod:`.security`);
* ``GET /static/<file>``: the stylesheet and the script, shipped in the package.

Every response body passes through :func:`mutexcron.urls.redact` for the store URL's secrets, on
top of the masking every part already does: no page can show the store's password.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl

from ..errors import ConfigurationError, MutexcronError
from ..locks import DEFAULT_LOCK_URL
from ..urls import redact
from .actions import ActionError, Actions, AuditLog
from .jobsfile import JobsFile, load_jobs_file
from .reads import StoreReader
from .security import TOKEN_ENV, Guard, operator
from .views import PAGES, Context, known_jobs, render_page

__all__ = ["Dashboard", "create_app"]

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]
_STATIC = {"dashboard.css": "text/css; charset=utf-8", "dashboard.js": "text/javascript; charset=utf-8"}
_HEADERS = [
    ("Content-Security-Policy",
     "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
     "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("X-Frame-Options", "DENY"),
    ("Cache-Control", "no-store"),
]  # fmt: skip
#: Largest action request body read.
MAX_BODY = 64 * 1024


def create_app(
    lock_url: str | None = None,
    *,
    jobs: str | None = None,
    action_token: str | None = None,
    refresh: float = 2.0,
) -> Dashboard:
    """The dashboard of one store, as a WSGI application (``.asgi`` for ASGI).

    Args:
        lock_url: the store [default: the jobs file's, else ``$MUTEXCRON_LOCK_URL``, else ``sqlite:///mutexcron.db``].
        jobs: a jobs file (``jobs.py``, ``module:attr``): its schedules give the missed-run alarms
            and the next fire times. Imported, never started.
        action_token: enables the actions; None: ``$MUTEXCRON_DASHBOARD_TOKEN``, else read-only.
        refresh: seconds between two refreshes of an open page.

    Raises:
        ConfigurationError: a bad URL, jobs file or token (nothing is served).
    """
    jobs_file = load_jobs_file(jobs) if jobs else None
    url = lock_url or (jobs_file.lock_url if jobs_file else None) or os.environ.get("MUTEXCRON_LOCK_URL") or DEFAULT_LOCK_URL
    token = action_token if action_token is not None else os.environ.get(TOKEN_ENV) or None
    return Dashboard(url, jobs=jobs_file, guard=Guard(token), refresh=refresh)


class Dashboard:
    """The WSGI application; see :func:`create_app`."""

    def __init__(self, url: str, *, jobs: JobsFile | None, guard: Guard, refresh: float) -> None:
        if refresh < 0.5:
            raise ConfigurationError(f"refresh every {refresh:g}s: use at least 0.5 s")
        self.url = url
        self.reader = StoreReader(url, min_interval=min(1.0, refresh / 2))
        self.reader.lock_store()  # a bad URL or a missing driver fails here, before anything is served
        self.jobs = jobs
        self.guard = guard
        self.refresh = refresh
        self.audit = AuditLog()
        self.actions = Actions(self.reader, self.audit, lambda: known_jobs(self.reader.snapshot(), self.jobs),
                               lambda: dict(jobs.shared) if jobs is not None else {})  # fmt: skip

    def close(self) -> None:
        self.reader.close()

    @property
    def asgi(self) -> Any:
        """This dashboard as an ASGI application (HTTP only), for ``app.mount("/mutexcron", dashboard.asgi)``."""
        from .asgi import WsgiToAsgi

        return WsgiToAsgi(self, max_body=MAX_BODY)

    # -- WSGI -------------------------------------------------------------------------------
    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "") or "/"
        try:
            status, ctype, body = self._route(environ, path.rstrip("/") if path != "/" else "/")
        except Exception:
            log.exception("dashboard request %s failed", path)
            status, ctype, body = (
                "500 Internal Server Error",
                "text/plain; charset=utf-8",
                "internal error: see the dashboard's log",
            )
        data = redact(body, self.url).encode("utf-8") if isinstance(body, str) else body
        start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(data))), *_HEADERS])
        return [data] if environ.get("REQUEST_METHOD") != "HEAD" else [b""]

    def _route(self, environ: dict[str, Any], path: str) -> tuple[str, str, str | bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        if path.startswith("/api/actions/"):
            return self._action(environ, path.removeprefix("/api/actions/"))
        if method not in ("GET", "HEAD"):
            return _json({"error": f"{method} is not allowed here"}, "405 Method Not Allowed")
        query = dict(parse_qsl(environ.get("QUERY_STRING", "")))
        if path == "/favicon.ico":
            return "204 No Content", "image/x-icon", b""
        if path.startswith("/static/"):
            return self._static(path.removeprefix("/static/"))
        if path.startswith("/api/sections/"):
            page = PAGES.get(_page_path(path.removeprefix("/api/sections/")))
            if page is None:
                return _json({"error": "no such page"}, "404 Not Found")
            ctx = self._context(environ, query, page.histories)
            sections = page.sections(ctx)
            return _json({"sections": sections, "at": ctx.snap.now.isoformat(), "calls": ctx.snap.calls,
                          "store_ms": round(ctx.snap.seconds * 1000, 3)})  # fmt: skip
        if path == "/api/status":
            return _json(self._status())
        if path == "/api/trigger":
            outcome = self.actions.trigger_outcome(query.get("job", ""), query.get("lock", ""), query.get("fire_time"))
            return _json(outcome)
        page = PAGES.get(path.strip("/"))
        if page is None:
            return "404 Not Found", "text/plain; charset=utf-8", "no such page"
        ctx = self._context(environ, query, page.histories)
        return "200 OK", "text/html; charset=utf-8", render_page(ctx, page, self.guard.csrf_token(), self.refresh)

    def _context(self, environ: dict[str, Any], query: dict[str, str], histories: bool) -> Context:
        return Context(environ.get("SCRIPT_NAME", "").rstrip("/"), self.reader, self.reader.snapshot(histories=histories),
                       self.jobs, self.guard.actions_enabled, self.audit.entries(), query)  # fmt: skip

    def _status(self) -> dict[str, Any]:
        snap = self.reader.snapshot(histories=True)
        return {
            "store": snap.store,
            "now": snap.now.isoformat(),
            "locks": None if snap.locks is None else [r.to_json() for r in snap.locks],
            "nodes": None if snap.nodes is None else [n.to_json() for n in snap.nodes],
            "history": {lock: [r.to_json() for r in runs] for lock, runs in snap.histories.items()},
            "tasks": None if snap.tasks is None else [vars(c) for c in snap.tasks],
            "errors": snap.errors,
            "notes": snap.notes,
            "calls": snap.calls,
        }

    def _static(self, name: str) -> tuple[str, str, bytes]:
        ctype = _STATIC.get(name)
        if ctype is None:
            return "404 Not Found", "text/plain; charset=utf-8", b"no such file"
        return "200 OK", ctype, resources.files(__package__).joinpath("static", name).read_bytes()

    # -- actions ----------------------------------------------------------------------------
    def _action(self, environ: dict[str, Any], name: str) -> tuple[str, str, str]:
        refusal = self.guard.refusal(environ)
        if refusal is not None:
            log.warning("dashboard action %s from %s refused: %s", name, environ.get("REMOTE_ADDR", "?"), refusal)
            return _json({"error": refusal}, "403 Forbidden")
        try:
            body = _body(environ)
            by = operator(body.get("by"), environ)
            result = self._act(name, body, by)
        except ActionError as exc:
            return _json({"error": str(exc)}, _status_line(exc.status))
        except MutexcronError as exc:  # the store failed: nothing or part of it was done; the message says what
            return _json({"error": str(exc)}, "503 Service Unavailable")
        self.reader.invalidate()
        return _json(result)

    def _act(self, name: str, body: dict[str, Any], by: str) -> dict[str, Any]:
        if name == "token":  # the page checks a token as it is entered: the guard let it through
            return {"message": f"token accepted: actions as {by}"}
        if name == "pause":
            return self.actions.pause(body.get("lock"), by)
        if name == "resume":
            return self.actions.resume(body.get("lock"), bool(body.get("catch_up")), by)
        if name == "trigger":
            return self.actions.trigger(body.get("job"), by)
        if name == "job_reschedule":
            return self.actions.reschedule(body.get("job"), body.get("schedule"), by)
        if name in ("job_pause", "job_resume", "job_remove"):
            return self.actions.shared_job(name.removeprefix("job_"), body.get("job"), by)
        if name == "retry":
            return self.actions.retry(body.get("code"), body.get("key"), by)
        if name == "cancel":
            return self.actions.cancel(body.get("code"), body.get("key"), by)
        if name == "bulk":
            selection = body.get("selection")
            return self.actions.bulk(
                body.get("action"), selection if isinstance(selection, dict) else {}, body.get("expected"), by
            )
        raise ActionError(f"no action {name!r}", 404)


def _page_path(name: str) -> str:
    return "" if name == "overview" else name


def _json(value: Any, status: str = "200 OK") -> tuple[str, str, str]:
    return status, "application/json", json.dumps(value, default=str)


def _status_line(code: int) -> str:
    return {400: "400 Bad Request", 404: "404 Not Found", 409: "409 Conflict"}.get(code, f"{code} Error")


def _body(environ: dict[str, Any]) -> dict[str, Any]:
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise ActionError("bad Content-Length") from None
    if length > MAX_BODY:
        raise ActionError("request too large")
    raw = environ["wsgi.input"].read(length) if length else b""
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise ActionError("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise ActionError("the request body must be a JSON object")
    return body
