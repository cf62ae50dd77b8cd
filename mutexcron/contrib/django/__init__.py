"""django-apscheduler, cluster-safe: add ``"mutexcron.contrib.django"`` to ``INSTALLED_APPS`` after
``"django_apscheduler"``.

* ``DjangoJobStore`` in a ``MutexScheduler`` is shared (:mod:`mutexcron.jobstores.django`): every node
  on the one table, each job once per fire time, ``DjangoJobExecution`` rows written once per fire
  time by the node that ran it.
* Locks (and tasks) go in the Django database (``DATABASES["default"]``) unless ``MUTEXCRON_LOCK_URL``
  is set, in the settings or the environment: :func:`lock_url`.
* ``python manage.py mutexcron run`` runs ``settings.MUTEXCRON_JOBS`` (``"app.jobs:sched"``) on this
  node, as ``mutexcron run`` does; start it on every node.
* The admin's "Run the selected django jobs" asks each job's lock holder to run it once now.
"""

from __future__ import annotations

import os

from ...errors import ConfigurationError
from ...locks import URL_ENV

try:
    import django_apscheduler  # noqa: F401 - the integration's dependency, named in the error below
except ImportError as exc:  # pragma: no cover - the extra not installed
    raise ConfigurationError(
        f"mutexcron.contrib.django needs django-apscheduler: pip install 'mutexcron[django]' ({exc})"
    ) from exc

__all__ = ["lock_url"]

#: The setting naming the jobs module the management command runs (``"app.jobs"`` or ``"app.jobs:sched"``).
JOBS_SETTING = "MUTEXCRON_JOBS"


def lock_url() -> str:
    """The lock store of this Django project: ``settings.MUTEXCRON_LOCK_URL``, else ``$MUTEXCRON_LOCK_URL``,
    else the database ``DATABASES["default"]`` (its host, name, user and password)."""
    from django.conf import settings

    from ...jobstores.django import database_url

    return str(getattr(settings, URL_ENV, None) or os.environ.get(URL_ENV) or database_url("default"))
