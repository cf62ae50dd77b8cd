"""The fixtures django-apscheduler's test suite expects (its source distribution ships the tests
without their conftest): written for mutexcron, copied into the unpacked sdist's ``tests/`` as
``conftest.py`` by tests/test_django_apscheduler_suite.py.

With ``MUTEXCRON_DJANGO_SHARED=1`` the ``jobstore`` fixture is mutexcron's shared flavour of
``DjangoJobStore``, started by a node that holds the lock of every job it can run
(:mod:`mutexcron_shared_django`); otherwise it is django-apscheduler's own store.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any
from unittest.mock import MagicMock, Mock

import pytest
import pytz
from apscheduler.executors.debug import DebugExecutor
from apscheduler.job import Job
from apscheduler.schedulers.base import BaseScheduler
from apscheduler.schedulers.blocking import BlockingScheduler
from django import db

SHARED = os.environ.get("MUTEXCRON_DJANGO_SHARED") == "1"


class DummyScheduler(BaseScheduler):  # type: ignore[misc]
    """A scheduler that never runs a loop: ``wakeup`` is a mock the tests can look at."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wakeup = MagicMock()

    def shutdown(self, wait: bool = True) -> None:
        super().shutdown(wait)

    def wakeup(self) -> None:  # replaced by the mock in __init__; defined for BaseScheduler's abstract method
        self._process_jobs()


def dummy_job() -> None:
    """A job that does nothing."""


def raise_db_operational_error(*args: Any, **kwargs: Any) -> None:
    """A mock's side effect: the database went away."""
    raise db.OperationalError("Some DB-related error")


@pytest.fixture
def timezone(monkeypatch: pytest.MonkeyPatch, settings: Any) -> Any:
    """The project's zone, and APScheduler's idea of the local zone set to it."""
    zone = pytz.timezone(settings.TIME_ZONE)  # the tests call its localize()
    monkeypatch.setattr("apscheduler.schedulers.base.get_localzone", Mock(return_value=zone))
    return zone


def _localized(when: datetime, zone: Any) -> datetime:
    return when if when.tzinfo is not None else zone.localize(when)


@pytest.fixture
def job_defaults(timezone: Any) -> dict[str, Any]:
    return {
        "trigger": "date",
        "trigger_args": {"run_date": _localized(datetime(2011, 4, 3, 18, 40), timezone), "timezone": timezone},
        "executor": "default", "args": (), "kwargs": {}, "id": "tést id", "name": "nämé",
        "misfire_grace_time": 1, "coalesce": False, "max_instances": 1,
    }  # fmt: skip


@pytest.fixture
def create_job(job_defaults: dict[str, Any], timezone: Any) -> Callable[..., Job]:
    def build(**overrides: Any) -> Job:
        fields = {**job_defaults, "scheduler": Mock(BaseScheduler, timezone=timezone), **overrides}
        fields["trigger"] = BlockingScheduler()._create_trigger(fields.pop("trigger"), fields.pop("trigger_args"))
        fields.setdefault("next_run_time", None)
        return Job(**fields)

    return build


@pytest.fixture
def create_add_job(timezone: Any, create_job: Callable[..., Job]) -> Callable[..., Job]:
    def build(jobstore: Any, func: Any = dummy_job, run_date: datetime = datetime(2999, 1, 1), id: str | None = None,
              paused: bool = False, **overrides: Any) -> Job:  # fmt: skip
        when = _localized(run_date, timezone)
        job = create_job(func=func, trigger="date", trigger_args={"run_date": when}, id=id, **overrides)
        job.next_run_time = None if paused else job.trigger.get_next_fire_time(None, when)
        if jobstore:
            jobstore.add_job(job)
        return job

    return build


@pytest.fixture
def jobstore() -> Iterator[Any]:
    from django.db import transaction
    from django_apscheduler.jobstores import DjangoJobStore
    from django_apscheduler.models import DjangoJob

    store = DjangoJobStore()
    if SHARED:
        from mutexcron_shared_django import start_shared

        start_shared(store, "djangojobstore")
    else:
        store.start(DummyScheduler(), "djangojobstore")
    yield store
    transaction.on_commit(DjangoJob.objects.all().delete)
    store.shutdown()


@pytest.fixture
def scheduler(jobstore: Any, settings: Any) -> Any:
    made = DummyScheduler(timezone=settings.TIME_ZONE)
    made.add_jobstore(jobstore, "default")
    made.add_executor(DebugExecutor())
    return made


@pytest.fixture
def use_seconds_format(settings: Any) -> str:
    settings.APSCHEDULER_DATETIME_FORMAT = "N j, Y, f:s"
    return str(settings.APSCHEDULER_DATETIME_FORMAT)


@pytest.fixture
def use_tz(settings: Any) -> str:
    settings.APSCHEDULER_DATETIME_FORMAT = "H"
    settings.USE_TZ = True
    return str(settings.APSCHEDULER_DATETIME_FORMAT)


@pytest.fixture
def use_hour_format(settings: Any) -> str:
    settings.APSCHEDULER_DATETIME_FORMAT = "H"
    return str(settings.APSCHEDULER_DATETIME_FORMAT)
