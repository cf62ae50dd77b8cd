"""Who may act, and how a request proves it.

The dashboard is read-only unless an action token is configured (``--action-token``, or the
environment variable :data:`TOKEN_ENV`). An action is a ``POST`` of JSON to ``/api/actions/...``
and is refused (403, nothing changed) unless it carries:

* the action token, as ``Authorization: Bearer <token>``: the browser keeps it in the tab's
  session storage and sends it itself; it is never a cookie, so no other site's page can make a
  browser send it;
* the page's CSRF token (``X-CSRF-Token``): an HMAC of a secret this process drew at start, which
  only a page served by this dashboard contains;
* ``Content-Type: application/json`` (a form of another site cannot send it without asking
  first), and an ``Origin``, if the browser sends one, that is this dashboard's own.

The operator's name, typed with the token, is recorded with the action as ``name (dashboard,
address)``: in the lock for pause and resume, in the request for a trigger, and in the log.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import unicodedata
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigurationError

__all__ = ["MIN_TOKEN_LENGTH", "TOKEN_ENV", "Guard"]

#: The environment variable that sets the action token.
TOKEN_ENV = "MUTEXCRON_DASHBOARD_TOKEN"  # noqa: S105 - the variable's name
#: A shorter token is refused: it could be guessed.
MIN_TOKEN_LENGTH = 16
_NAME_LIMIT = 64


class Guard:
    """The action token (None: read-only) and this process's CSRF secret."""

    def __init__(self, token: str | None) -> None:
        if token is not None and len(token) < MIN_TOKEN_LENGTH:
            raise ConfigurationError(
                f"the dashboard's action token is {len(token)} characters long: use at least {MIN_TOKEN_LENGTH} "
                '(e.g. python -c "import secrets; print(secrets.token_urlsafe(24))")'
            )
        self._token = token.encode() if token else None
        self._secret = secrets.token_bytes(32)

    @property
    def actions_enabled(self) -> bool:
        return self._token is not None

    def csrf_token(self) -> str:
        return hmac.new(self._secret, b"mutexcron-dashboard-csrf", hashlib.sha256).hexdigest()

    def refusal(self, environ: Mapping[str, Any]) -> str | None:
        """Why the action request ``environ`` is refused, or None if it may act."""
        if self._token is None:
            return f"the dashboard is read-only: start it with --action-token or {TOKEN_ENV} to enable actions"
        if environ.get("REQUEST_METHOD") != "POST":
            return "actions are POST requests"
        if environ.get("CONTENT_TYPE", "").split(";")[0].strip().lower() != "application/json":
            return "actions are sent as application/json"
        origin = environ.get("HTTP_ORIGIN")
        if origin and origin.split("://", 1)[-1] != environ.get("HTTP_HOST", ""):
            return f"cross-origin request from {origin!r} refused"
        sent = environ.get("HTTP_X_CSRF_TOKEN", "")
        if not hmac.compare_digest(sent.encode(), self.csrf_token().encode()):
            return "missing or stale CSRF token: reload the page"
        scheme, _, token = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._token):
            return "missing or wrong action token"
        return None


def operator(name: Any, environ: Mapping[str, Any]) -> str:
    """``name (dashboard, address)``, with the name cut to printable text: who did an action."""
    text = "".join(c for c in str(name or "") if unicodedata.category(c)[0] not in "CZ" or c == " ").strip()
    return f"{text[:_NAME_LIMIT] or 'anonymous'} (dashboard, {environ.get('REMOTE_ADDR') or '?'})"
