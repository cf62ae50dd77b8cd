"""Where a scheduler with shared job stores keeps its locks: the job store's own database when no
lock store is configured, and never a store only one host can reach.

A shared job runs once per fire time only if every node claims it in the same lock store. A node
that falls back to the default SQLite file in its working directory guards its jobs on its own,
so with a shared job store and no lock URL the locks (and tasks) go where the jobs are; a SQLite
lock store beside a job store on a server is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from ..errors import ConfigurationError
from ..urls import mask_url, url_scheme
from . import is_shared

__all__ = ["lock_url_of", "refuse_local_lock_store", "shared_lock_url", "sql_lock_url"]


def sql_lock_url(url: Any) -> str | None:
    """The lock store URL on the database of the SQLAlchemy URL ``url``: mutexcron's scheme for its
    dialect, the rest (credentials, driver options such as ``sslmode``) kept. None for a database in
    one process's memory or a dialect mutexcron has no store for."""
    backend = url.get_backend_name()
    if backend == "sqlite":
        if url.database in (None, "", ":memory:"):
            return None  # a job store in this process's memory: nothing to share
        return f"sqlite:///{url.database}"
    if backend not in ("postgresql", "mysql", "mariadb"):
        return None
    return str(url.set(drivername="mysql" if backend == "mariadb" else backend).render_as_string(hide_password=False))


def _redis_lock_url(store: Any) -> str | None:
    pool = store.redis.connection_pool
    kw = pool.connection_kwargs
    db = int(kw.get("db") or 0)
    if kw.get("path"):
        return f"unix://{kw['path']}?db={db}"
    user, password = kw.get("username") or "", kw.get("password") or ""
    auth = f"{quote(str(user), safe='')}:{quote(str(password), safe='')}@" if (user or password) else ""
    scheme = "rediss" if "SSL" in pool.connection_class.__name__ else "redis"
    return f"{scheme}://{auth}{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{db}"


def lock_url_of(store: Any) -> str | None:
    """The lock store URL on the database of the shared job store ``store`` (None: it cannot be told).

    A store family that knows its own database says so with a ``lock_url()`` method (Django's).
    """
    own = getattr(store, "lock_url", None)
    if callable(own):
        url: str = own()
        return url
    if hasattr(store, "engine") and hasattr(store, "jobs_t"):
        return sql_lock_url(store.engine.url)
    if hasattr(store, "redis") and hasattr(store, "jobs_key"):
        return _redis_lock_url(store)
    return None  # MongoDB: its client does not give back the URL it was built from


def _shared_stores(jobstores: Mapping[str, Any]) -> list[tuple[str, Any]]:
    ordered = sorted(jobstores.items(), key=lambda item: item[0] != "default")  # "default" first
    return [(alias, store) for alias, store in ordered if is_shared(store)]


def shared_lock_url(jobstores: Mapping[str, Any]) -> str | None:
    """The lock URL for a scheduler given none: its first shared job store's database (None: no
    shared store). Raises ConfigurationError, naming the fix, when that database cannot be told."""
    shared = _shared_stores(jobstores)
    if not shared:
        return None
    alias, store = shared[0]
    url = lock_url_of(store)
    if url is None:
        raise ConfigurationError(
            f"job store {alias!r} is shared by every node, but mutexcron cannot tell its server's URL to keep "
            "the locks there: set lock_url= (or --lock-url, MUTEXCRON_LOCK_URL) to a store every node reaches, "
            "e.g. the same MongoDB server (mongodb://host/db)"
        )
    return url


def refuse_local_lock_store(lock_url: str, jobstores: Mapping[str, Any]) -> None:
    """Refuse a SQLite lock store (one host's file) beside a shared job store on a server: every
    host would guard the shared jobs in a file of its own, and run each of them."""
    if url_scheme(lock_url) != "sqlite":
        return
    for alias, store in _shared_stores(jobstores):
        url = lock_url_of(store)
        if url is not None and url_scheme(url) == "sqlite":
            continue  # a SQLite job store: one host already
        raise ConfigurationError(
            f"lock store {mask_url(lock_url)} is a SQLite file only this host reaches, but job store {alias!r} "
            "is shared by nodes on other hosts too: each would run every shared job. Leave lock_url unset (the "
            "locks then go to the job store's database) or set it to a store every node reaches"
        )
