"""Lock stores, chosen by URL scheme. Drivers are imported only when a store is built."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..backends import FAMILIES, build, family_of
from ..errors import ConfigurationError
from ..urls import url_scheme
from .base import AcquireResult, BatchClaimResult, FireClaim, HandOff, HeldClaim, LockStore, Node, Presence, RunInfo
from .record import NodePresence, RunRecord

__all__ = [
    "DEFAULT_LOCK_URL",
    "SCHEMES",
    "URL_ENV",
    "AcquireResult",
    "BatchClaimResult",
    "FireClaim",
    "HandOff",
    "HeldClaim",
    "LockStore",
    "Node",
    "NodePresence",
    "Presence",
    "RunInfo",
    "RunRecord",
    "default_lock_url",
    "defaulted_urls",
    "lock_store_from_url",
    "store_scope_note",
]

#: The store when none is configured: a SQLite file in the working directory, resolved to an
#: absolute path when the store is built (logs and ``status`` show which file). It joins only the
#: processes of one host that use this same file; the start-up log says so.
DEFAULT_LOCK_URL = "sqlite:///mutexcron.db"
#: The environment variable every mutexcron object and command reads the store URL from.
URL_ENV = "MUTEXCRON_LOCK_URL"


_defaulted: set[tuple[str, str]] = set()  # (what, URL) of the objects that took the default URL


def default_lock_url(what: str | None = None) -> str:
    """The store URL of an object given none: ``$MUTEXCRON_LOCK_URL``, else :data:`DEFAULT_LOCK_URL`.

    ``mutexcron run --lock-url URL`` sets ``MUTEXCRON_LOCK_URL`` for its process before it imports
    the jobs file, so every ``Mutex()``, ``TaskPool()`` and scheduler built there without a URL
    uses the run's store.

    Args:
        what: the object asking (``"Mutex()"``), remembered for :func:`defaulted_urls`.
    """
    url = os.environ.get(URL_ENV) or DEFAULT_LOCK_URL
    if what is not None:
        _defaulted.add((what, url))
    return url


def defaulted_urls() -> set[tuple[str, str]]:
    """(what, URL) of every object of this process that took the default store URL: ``mutexcron
    run`` warns when one differs from the scheduler's store."""
    return set(_defaulted)


def store_scope_note(url: str, *, defaulted: bool) -> tuple[int, str] | None:
    """For a SQLite store, the start-up log line (level, message) saying which processes it joins.

    Args:
        url: the store's URL (its SQLite path already absolute).
        defaulted: no URL was configured: the line is a WARNING.
    """
    if url_scheme(url) != "sqlite":
        return None
    path = url.partition(":///")[2].partition("?")[0] or "?"
    scope = f"a SQLite store only joins processes on this host that use this same file, {path}"
    if defaulted:
        return logging.WARNING, (
            f"no lock store configured (--lock-url, {URL_ENV} or lock_url=): using the default, {scope}; nodes on "
            "other servers or in another working directory guard their jobs on their own. Set the store URL on every node"
        )
    return logging.INFO, f"{scope}; for several servers use MySQL, PostgreSQL, Redis or MongoDB"

#: URL scheme -> ("module:Class", extra to install for its driver, or None), from the one
#: registry of store families (:data:`mutexcron.backends.FAMILIES`).
SCHEMES: dict[str, tuple[str, str | None]] = {
    scheme: (row.lock_store, row.extra) for row in FAMILIES for scheme in row.schemes
}


def lock_store_from_url(url: str, **options: Any) -> LockStore:
    """Build the lock store for ``url``.

    Args:
        url: the lock URL; its scheme selects the store (:data:`SCHEMES`).
        **options: passed to the store class (and from there to its backend).

    Raises:
        ConfigurationError: the URL has no known scheme, or its driver is not installed.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigurationError(f"empty lock URL; use one of the schemes {', '.join(SCHEMES)} (default {DEFAULT_LOCK_URL})")
    url = url.strip()
    row = family_of(url, "lock")
    store: LockStore = build(row, row.lock_store, url, **options)
    return store
