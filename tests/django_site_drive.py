"""What a web process of examples/django_apscheduler_site does (tests/test_contrib_django.py), one
action per call: ``python tests/django_site_drive.py ACTION JOB`` (the site on ``PYTHONPATH``).

add / pause / resume / remove: through a paused MutexScheduler on the DjangoJobStore (a process that
only changes jobs); admin-run: the admin's "run selected jobs" action, as a logged-in superuser; failed-request: a
failed run request left for the job; executions: the job's DjangoJobExecution rows as JSON."""

import json
import os
import sys
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "site_settings.settings")
import django

django.setup()


def change(action: str, job: str) -> None:
    from django_apscheduler.jobstores import DjangoJobStore
    from reports.jobs import record

    from mutexcron import MutexScheduler

    sched = MutexScheduler(jobstores={"default": DjangoJobStore()}, triggers=False)
    sched.start(paused=True)
    try:
        if action == "add":
            sched.add_job(record, "interval", seconds=1, args=[job], id=job)
        else:
            getattr(sched, f"{action}_job")(job)
    finally:
        sched.shutdown()


def remove_racing_a_run(job: str) -> None:
    """Add ``job``, then remove it while a holder records a run of it: the run's DjangoJobExecution row
    lands (on a connection of its own, committed) after Django deleted the job's rows and before it
    deletes the job, as a node's run can. The removal must go through; prints the rows and jobs left."""
    from django.db import connections
    from django.db.models.sql.subqueries import DeleteQuery
    from django_apscheduler.models import DjangoJob, DjangoJobExecution

    change("add", job)
    delete_batch = DeleteQuery.delete_batch
    raced: list[bool] = []

    def a_run_lands_first(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not raced and self.model is DjangoJob:
            raced.append(True)
            other = connections.create_connection("default")  # what another node's run does
            with other.cursor() as cursor:
                cursor.execute("INSERT INTO django_apscheduler_djangojobexecution (job_id, status, run_time) "
                               "VALUES (%s, %s, %s)", [job, "Started execution", "2030-01-01T00:00:00+00:00"])
            other.commit()
            other.close()
        return delete_batch(self, *args, **kwargs)

    DeleteQuery.delete_batch = a_run_lands_first
    change("remove", job)
    print(json.dumps({"raced": bool(raced), "jobs": DjangoJob.objects.filter(id=job).count(),
                      "rows": DjangoJobExecution.objects.filter(job_id=job).count()}))


def admin_run(job: str) -> None:
    from django.contrib.auth.models import User
    from django.contrib.messages import get_messages
    from django.test import Client

    user = User.objects.filter(username="admin").first() or User.objects.create_superuser("admin", "a@example.com", "pw")
    client = Client()
    client.force_login(user)
    reply = client.post("/admin/django_apscheduler/djangojob/", {"action": "run_selected_jobs", "_selected_action": [job]})
    print(json.dumps({"status": reply.status_code, "messages": [str(m) for m in get_messages(reply.wsgi_request)]}))


def failed_request(job: str) -> None:
    """Leave a failed run request for ``job`` (as one whose holder lacked the job): the admin's next
    "run selected jobs" must withdraw it, not join it."""
    from datetime import timedelta

    from mutexcron.contrib.django import lock_url
    from mutexcron.guard.triggers import trigger_code
    from mutexcron.tasks import Fail, task_store_from_url

    store, code = task_store_from_url(lock_url()), trigger_code(job)
    try:
        store.add(code, job, timedelta(0), {"requested_by": "an earlier click"})
        token = store.claim("another-node", [code], 1, 30.0)[0].token
        store.start("another-node", [(code, job, token)])
        store.complete("another-node", code, job, token, Fail("job not on its holder"))
        print(json.dumps({"state": getattr(store.get(code, job), "state", None)}))
    finally:
        store.close()


def executions(job: str) -> None:
    from django_apscheduler.models import DjangoJobExecution

    rows = DjangoJobExecution.objects.filter(job_id=job).values_list("run_time", "status")
    print(json.dumps([[when.timestamp(), status] for when, status in rows]))


if __name__ == "__main__":
    action, job = sys.argv[1], sys.argv[2]
    actions = {"admin-run": admin_run, "executions": executions, "remove-racing-a-run": remove_racing_a_run,
               "failed-request": failed_request}  # fmt: skip
    actions.get(action, lambda j: change(action, j))(job)
