"""Shared APScheduler job stores: every node on one ``SQLAlchemyJobStore``, ``RedisJobStore``,
``MongoDBJobStore`` or django-apscheduler's ``DjangoJobStore``, each job once per fire time across the cluster.

``MutexScheduler.start()`` turns each of the scheduler's persistent job stores into its shared
flavour (a subclass of APScheduler's own class, on the same data: :data:`SHAREABLE`). The family's
module (and so its driver) is imported only for a store of that family. A ``MemoryJobStore`` keeps
today's behaviour; any other job store class is refused, since mutexcron could not tell how to
keep its jobs once per fire time.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from apscheduler.jobstores.memory import MemoryJobStore

from .base import SharedJobStore

log = logging.getLogger(__name__)

__all__ = ["SHAREABLE", "SharedJobStore", "is_shared", "share"]

#: APScheduler's job store class -> its shared flavour ("module:class" under this package).
SHAREABLE: dict[str, str] = {
    "apscheduler.jobstores.sqlalchemy.SQLAlchemyJobStore": "sqlalchemy:SharedSQLAlchemyJobStore",
    "apscheduler.jobstores.redis.RedisJobStore": "redis:SharedRedisJobStore",
    "apscheduler.jobstores.mongodb.MongoDBJobStore": "mongodb:SharedMongoDBJobStore",
    "django_apscheduler.jobstores.DjangoJobStore": "django:SharedDjangoJobStore",  # django-apscheduler's
}


def _name(store: Any) -> str:
    cls = type(store)
    return f"{cls.__module__}.{cls.__qualname__}"


def is_shared(store: Any) -> bool:
    """True for a job store every node shares: one of :data:`SHAREABLE`, or its shared flavour."""
    return isinstance(store, SharedJobStore) or _name(store) in SHAREABLE


def check(store: Any, alias: str) -> None:
    """Warn, once per store, of a job store mutexcron can neither share nor keep local for sure.

    Such a store is left as it is, as APScheduler would use it (a drop-in: APScheduler's own tests
    use stores of their own): guarded jobs in it are still claimed once per fire time through their
    lock, but if several nodes share it, its unguarded jobs run on every node.
    """
    if isinstance(store, MemoryJobStore) or is_shared(store) or getattr(store, "_mutexcron_warned", False) is True:
        return
    supported = ", ".join(name.rpartition(".")[2] for name in SHAREABLE)
    log.warning(
        "job store %r is a %s: mutexcron shares %s (APScheduler's own classes, not subclasses of them) and "
        "keeps MemoryJobStore local; this one is used as it is, unshared. If several nodes share it, its "
        "unguarded jobs run on every node: use one of those",
        alias,
        type(store).__name__,
        supported,
    )
    try:
        store._mutexcron_warned = True
    except AttributeError:  # a store with __slots__: warned again next time
        pass


def share(store: Any, alias: str) -> Any:
    """``store`` as its shared flavour (the same object, its class swapped: the same connection and data)."""
    check(store, alias)
    if not is_shared(store) or isinstance(store, SharedJobStore):
        return store  # memory, or a store mutexcron does not know: kept as it is
    module_name, _, class_name = SHAREABLE[_name(store)].partition(":")
    shared_class = getattr(importlib.import_module(f"{__name__}.{module_name}"), class_name)
    store.__class__ = shared_class
    return store
