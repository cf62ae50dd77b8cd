"""A pytest plugin for APScheduler's own ``tests/test_schedulers.py``: the same tests with
mutexcron's mixin in place of APScheduler's schedulers (``-p mutexcron_dropin``).

``DummyScheduler`` gets :class:`~mutexcron.scheduler.MutexSchedulerMixin` mixed in, and the
Background, Blocking and AsyncIO schedulers the tests build become mutexcron's, each on its own
in-memory lock store. Used by ``tests/test_apscheduler_dropin.py``.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import pytest

from mutexcron.asyncio_scheduler import AsyncIOMutexScheduler
from mutexcron.scheduler import BlockingMutexScheduler, MutexScheduler, MutexSchedulerMixin

_stores = itertools.count()


def _memory(kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs.setdefault("lock_url", f"memory://dropin-{next(_stores)}")
    return kwargs


class _Background(MutexScheduler):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **_memory(kwargs))


class _Blocking(BlockingMutexScheduler):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **_memory(kwargs))


class _AsyncIO(AsyncIOMutexScheduler):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **_memory(kwargs))


def _substitute(module: Any) -> None:
    dummy = module.DummyScheduler

    class DummyScheduler(MutexSchedulerMixin, dummy):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **_memory(kwargs))

    module.DummyScheduler = DummyScheduler
    module.AsyncIOScheduler = _AsyncIO


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    import apscheduler.schedulers.background as background
    import apscheduler.schedulers.blocking as blocking

    background.BackgroundScheduler = _Background  # type: ignore[misc]  # the tests import them in fixtures
    blocking.BlockingScheduler = _Blocking  # type: ignore[misc]
    found = [m for name, m in list(sys.modules.items()) if name.endswith("test_schedulers") and hasattr(m, "DummyScheduler")]
    if not found:
        raise pytest.UsageError("mutexcron_dropin: tests/test_schedulers.py was not collected")
    for module in found:
        _substitute(module)
