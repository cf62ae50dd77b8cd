"""Lock stores, chosen by URL scheme. Drivers are imported only when a store is built."""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import ConfigurationError
from ..urls import mask_url, url_scheme
from .base import AcquireResult, FireClaim, LockStore, Node, RunInfo

__all__ = [
    "DEFAULT_LOCK_URL",
    "SCHEMES",
    "AcquireResult",
    "FireClaim",
    "LockStore",
    "Node",
    "RunInfo",
    "lock_store_from_url",
]

DEFAULT_LOCK_URL = "sqlite:///mutexcron.db"

#: URL scheme -> ("module:Class", extra to install for its driver, or None)
SCHEMES: dict[str, tuple[str, str | None]] = {
    "memory": ("mutexcron.locks.memory:MemoryLockStore", None),
    "sqlite": ("mutexcron.locks.sql:SQLLockStore", None),
    "mysql": ("mutexcron.locks.sql:SQLLockStore", "mysql"),
    "mysql+pymysql": ("mutexcron.locks.sql:SQLLockStore", "mysql"),
    "mariadb": ("mutexcron.locks.sql:SQLLockStore", "mysql"),
    "mariadb+pymysql": ("mutexcron.locks.sql:SQLLockStore", "mysql"),
    "postgresql": ("mutexcron.locks.sql:SQLLockStore", "postgresql"),
    "postgresql+psycopg": ("mutexcron.locks.sql:SQLLockStore", "postgresql"),
    "postgres": ("mutexcron.locks.sql:SQLLockStore", "postgresql"),
    "redis": ("mutexcron.locks.redis:RedisLockStore", "redis"),
    "rediss": ("mutexcron.locks.redis:RedisLockStore", "redis"),
    "unix": ("mutexcron.locks.redis:RedisLockStore", "redis"),
    "redis+sentinel": ("mutexcron.locks.redis:RedisLockStore", "redis"),
    "redis+cluster": ("mutexcron.locks.redis:RedisLockStore", "redis"),
    "rediss+cluster": ("mutexcron.locks.redis:RedisLockStore", "redis"),
    "mongodb": ("mutexcron.locks.mongodb:MongoDBLockStore", "mongodb"),
    "mongodb+srv": ("mutexcron.locks.mongodb:MongoDBLockStore", "mongodb"),
}


def lock_store_from_url(url: str, **options: Any) -> LockStore:
    """Build the lock store for ``url``.

    Raises:
        ConfigurationError: the URL has no known scheme, or its driver is not installed.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigurationError(f"empty lock URL; use one of the schemes {', '.join(SCHEMES)} (default {DEFAULT_LOCK_URL})")
    url = url.strip()
    scheme = url_scheme(url)
    if scheme not in SCHEMES:
        raise ConfigurationError(
            f"unsupported lock URL {mask_url(url)!r}: scheme {scheme or '(none)'!r} is not one of "
            f"{', '.join(s + '://' for s in SCHEMES)}"
        )
    target, extra = SCHEMES[scheme]
    module_name, _, class_name = target.partition(":")
    try:
        cls: type[LockStore] = getattr(importlib.import_module(module_name), class_name)
        return cls(url, **options)
    except ModuleNotFoundError as exc:  # a driver the extra provides
        hint = f'pip install "mutexcron[{extra}]"' if extra else "reinstall mutexcron"
        raise ConfigurationError(
            f"the {scheme}:// lock store needs the {exc.name!r} driver, which is not installed: {hint}"
        ) from exc
