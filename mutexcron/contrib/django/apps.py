"""The Django app: at start-up, this process's schedulers, task pools and locks default to the
project's lock store (:func:`mutexcron.contrib.django.lock_url`)."""

from __future__ import annotations

import logging
import os

from django.apps import AppConfig

from ...errors import ConfigurationError
from ...locks import URL_ENV
from ...urls import mask_url

log = logging.getLogger(__name__)


class MutexcronConfig(AppConfig):  # type: ignore[misc]
    name = "mutexcron.contrib.django"
    label = "mutexcron"
    verbose_name = "mutexcron"

    def ready(self) -> None:
        from . import lock_url

        if os.environ.get(URL_ENV):
            return
        try:
            url = lock_url()
        except ConfigurationError as exc:  # the site still starts; the schedulers say where the locks went
            log.warning("mutexcron: %s", exc)
            return
        os.environ[URL_ENV] = url  # what every MutexScheduler(), TaskPool() and Mutex() built without a URL uses
        log.debug("mutexcron: locks in %s", mask_url(url))
