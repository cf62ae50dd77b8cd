"""django-apscheduler's job admin, with "Run the selected django jobs" acting through the cluster:
each selected job is run once now by the node that holds its lock (``mutexcron trigger``'s request),
not in the web process."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib import admin, messages
from django.utils.html import format_html
from django_apscheduler.admin import DjangoJobAdmin
from django_apscheduler.models import DjangoJob

from ...guard.run_requests import withdraw_stale_request
from ...guard.triggers import trigger_code
from ...tasks import task_store_from_url
from . import lock_url

#: Who the admin's run requests say asked for them.
REQUESTED_BY = "Django admin"


class ClusterDjangoJobAdmin(DjangoJobAdmin):  # type: ignore[misc]
    """``DjangoJobAdmin`` whose "run selected jobs" goes through each job's lock holder."""

    actions = ["run_selected_jobs"]

    @admin.action(description="Run the selected django jobs (on the node holding each job's lock)")  # type: ignore[untyped-decorator]
    def run_selected_jobs(self, request: Any, queryset: Any) -> None:
        timeout = float(getattr(settings, "APSCHEDULER_RUN_NOW_TIMEOUT", 15))
        store = task_store_from_url(lock_url())
        try:
            asked = []
            for job in queryset:
                withdraw_stale_request(store, trigger_code(job.id), job.id)  # a failed earlier request never answers this one
                store.add(trigger_code(job.id), job.id, timedelta(0), {"requested_by": f"{REQUESTED_BY} ({request.user})"},
                          on_conflict="keep")  # fmt: skip
                asked.append(job.id)
            pending = _wait_for(store, asked, timeout)
        finally:
            store.close()
        for job_id in asked:
            if job_id in pending:
                self.message_user(request, format_html("Job '{}': {}", job_id, pending[job_id]), messages.ERROR)
            else:
                self.message_user(request, format_html("Executed job '{}' on the node holding its lock", job_id))


def _wait_for(store: Any, jobs: list[str], timeout: float) -> dict[str, str]:
    """Wait up to ``timeout`` seconds for the requests of ``jobs`` to complete; {job: why not} for the rest."""
    deadline = time.monotonic() + timeout
    pending: dict[str, str] = {}
    while True:
        pending = {}
        for job_id in jobs:
            task = store.get(trigger_code(job_id), job_id)
            if task is not None and task.state == "failed":
                pending[job_id] = f"not run: {task.last_error}"
            elif task is not None:
                pending[job_id] = f"still waiting for a node to run it after {timeout:g}s (requested; it runs when one can)"
        if all(why.startswith("not run") for why in pending.values()) or time.monotonic() >= deadline:
            return pending
        time.sleep(0.1)


if admin.site.is_registered(DjangoJob):
    admin.site.unregister(DjangoJob)
admin.site.register(DjangoJob, ClusterDjangoJobAdmin)
