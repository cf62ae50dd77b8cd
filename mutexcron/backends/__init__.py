"""Backends, one per store family, and the one registry that routes a URL scheme to them.

:data:`FAMILIES` is the only list of URL schemes in mutexcron: each row names a family's schemes,
the pip extra that installs its driver, its backend class and the store classes built on that
backend (``"module:Class"``, imported only when a URL of that family is used). The lock store
registry (:data:`mutexcron.locks.SCHEMES`, :func:`mutexcron.locks.lock_store_from_url`) and each
backend's URL check are derived from it; ``tests/test_registry.py`` checks that they agree.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError
from ..urls import mask_url, url_scheme

if TYPE_CHECKING:
    from .base import Backend

__all__ = ["FAMILIES", "StoreFamily", "backend_from_url", "build", "family", "family_of", "load"]


@dataclass(frozen=True)
class StoreFamily:
    """One row of the registry: a kind of store and what serves it."""

    #: The family's name: the module names, the extra and the pytest marker follow it where they can.
    name: str
    #: URL schemes (lower case) that select this family.
    schemes: tuple[str, ...]
    #: ``pip install "mutexcron[<extra>]"`` installs the driver; None: nothing beyond mutexcron itself.
    extra: str | None
    #: Driver modules the extra installs, imported before the store so a missing one names the fix.
    drivers: tuple[str, ...]
    #: ``"module:Class"`` of the backend (connection, URL options, clock, errors).
    backend: str
    #: ``"module:Class"`` of the lock store on that backend.
    lock_store: str
    #: ``"module:Class"`` of the task store on that backend (the durable task pool); None: none yet.
    task_store: str | None = None


_SQL = "mutexcron.backends.sql:SQLBackend"
_SQL_LOCKS = "mutexcron.locks.sql:SQLLockStore"
_SQL_TASKS = "mutexcron.tasks.stores.sql:SQLTaskStore"

FAMILIES: tuple[StoreFamily, ...] = (
    StoreFamily(
        name="memory",
        schemes=("memory",),
        extra=None,
        drivers=(),
        backend="mutexcron.backends.memory:MemoryBackend",
        lock_store="mutexcron.locks.memory:MemoryLockStore",
        task_store="mutexcron.tasks.stores.memory:MemoryTaskStore",
    ),
    StoreFamily(
        name="sqlite", schemes=("sqlite",), extra=None, drivers=(), backend=_SQL, lock_store=_SQL_LOCKS, task_store=_SQL_TASKS
    ),
    StoreFamily(
        name="mysql",
        schemes=("mysql", "mysql+pymysql", "mariadb", "mariadb+pymysql"),
        extra="mysql",
        drivers=("pymysql",),
        backend=_SQL,
        lock_store=_SQL_LOCKS,
        task_store=_SQL_TASKS,
    ),
    StoreFamily(
        name="postgresql",
        schemes=("postgresql", "postgresql+psycopg", "postgres"),
        extra="postgresql",
        drivers=("psycopg",),
        backend=_SQL,
        lock_store=_SQL_LOCKS,
        task_store=_SQL_TASKS,
    ),
    StoreFamily(
        name="redis",
        schemes=("redis", "rediss", "unix", "redis+sentinel", "redis+cluster", "rediss+cluster"),
        extra="redis",
        drivers=("redis",),
        backend="mutexcron.backends.redis:RedisBackend",
        lock_store="mutexcron.locks.redis:RedisLockStore",
        task_store="mutexcron.tasks.stores.redis:RedisTaskStore",
    ),
    StoreFamily(
        name="mongodb",
        schemes=("mongodb", "mongodb+srv"),
        extra="mongodb",
        drivers=("pymongo",),
        backend="mutexcron.backends.mongodb:MongoDBBackend",
        lock_store="mutexcron.locks.mongodb:MongoDBLockStore",
        task_store="mutexcron.tasks.stores.mongodb:MongoDBTaskStore",
    ),
)

_BY_SCHEME: dict[str, StoreFamily] = {scheme: row for row in FAMILIES for scheme in row.schemes}
_BY_NAME: dict[str, StoreFamily] = {row.name: row for row in FAMILIES}


def family(name: str) -> StoreFamily:
    """The registry row named ``name`` (``"redis"``, ``"mysql"``...)."""
    return _BY_NAME[name]


def family_of(url: str, what: str = "store") -> StoreFamily:
    """The registry row for ``url``'s scheme.

    Args:
        url: a store URL.
        what: how messages name the URL ("lock", "store").

    Raises:
        ConfigurationError: the URL has no scheme mutexcron knows.
    """
    scheme = url_scheme(url)
    row = _BY_SCHEME.get(scheme)
    if row is None:
        raise ConfigurationError(
            f"unsupported {what} URL {mask_url(url)!r}: scheme {scheme or '(none)'!r} is not one of "
            f"{', '.join(s + '://' for s in _BY_SCHEME)}"
        )
    return row


def load(row: StoreFamily, target: str) -> Any:
    """Import ``target`` (``"module:Class"``, one of ``row``'s), the family's drivers first.

    Raises:
        ConfigurationError: a driver is not installed; the message says which extra installs it.
    """
    module_name, _, attribute = target.partition(":")
    try:
        for driver in row.drivers:
            importlib.import_module(driver)
        return getattr(importlib.import_module(module_name), attribute)
    except ModuleNotFoundError as exc:
        raise _missing_driver(row, exc) from exc


def build(row: StoreFamily, target: str, url: str, **options: Any) -> Any:
    """``target(url, **options)``: a backend or a store of family ``row``, imported on first use.

    Raises:
        ConfigurationError: a driver is not installed, or the URL or an option is bad.
    """
    cls = load(row, target)
    try:
        return cls(url, **options)
    except ModuleNotFoundError as exc:  # a driver imported lazily by the driver stack itself
        raise _missing_driver(row, exc) from exc


def _missing_driver(row: StoreFamily, exc: ModuleNotFoundError) -> ConfigurationError:
    hint = f'pip install "mutexcron[{row.extra}]"' if row.extra else "reinstall mutexcron"
    return ConfigurationError(f"the {row.name} store needs the {exc.name!r} driver, which is not installed: {hint}")


def backend_from_url(url: str, **options: Any) -> Backend:
    """Build the backend for ``url``: the floor a lock store or a task store stands on.

    Raises:
        ConfigurationError: unknown scheme, missing driver, or a bad URL or option.
    """
    row = family_of(url)
    backend: Backend = build(row, row.backend, url, **options)
    return backend
