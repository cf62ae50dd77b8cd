"""The shop's jobs module: run it on every worker node, next to (not inside) the web servers.

    cd examples/django_shop
    DJANGO_SETTINGS_MODULE=shop.settings mutexcron run orders/jobs.py

``close_unpaid_order`` tasks, added by the web app when an order is created (orders/views.py), run
here when due: on one node at a time, under a lease the node renews while the handler runs.
"""

import logging
import os
import sys
from pathlib import Path

# `mutexcron run orders/jobs.py` imports this file by its path: put the project directory on
# sys.path so that `shop` (the settings) and `orders` (the app) import as they do under manage.py.
PROJECT_DIR = str(Path(__file__).resolve().parent.parent)
if PROJECT_DIR not in sys.path:
    sys.path.insert(0, PROJECT_DIR)
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")

import django  # noqa: E402

django.setup()  # the app registry must be ready before any model is imported

from django.conf import settings  # noqa: E402
from django.db import close_old_connections, connection, transaction  # noqa: E402
from django.utils import timezone  # noqa: E402

from mutexcron import MutexScheduler  # noqa: E402
from orders.models import Order  # noqa: E402
from orders.pool import CLOSE_UNPAID_ORDER  # noqa: E402

log = logging.getLogger("orders.jobs")
sched = MutexScheduler(lock_url=settings.MUTEXCRON_LOCK_URL)  # `mutexcron run --lock-url` overrides it


@sched.tasks.handler(CLOSE_UNPAID_ORDER, lease=30, max_attempts=5, backoff=10)
def close_unpaid_order(task):
    """Close the order ``task.key`` if it is still unpaid.

    One conditional UPDATE: it closes only an unpaid order, so a payment that lands first wins. It
    commits with the task's completion (``task.complete(connection)``), so a run whose lease was
    taken over changes nothing. A missing order is not an error.
    """
    close_old_connections()  # handler threads live long: drop connections Django would not reuse
    try:
        with transaction.atomic():  # the close and the end of the task commit together
            closed = Order.objects.filter(pk=int(task.key), status=Order.Status.UNPAID).update(
                status=Order.Status.CLOSED, closed_at=timezone.now()
            )
            # The fenced completion the worker would run after the handler, in this transaction: if
            # this node's lease ran out and another node took the task over, it raises
            # StaleTaskError and the close above rolls back with it.
            task.complete(connection)
    finally:
        close_old_connections()
    if closed:
        log.info("closed unpaid order %s (%s cents), due %s", task.key, task.payload["amount_cents"], task.due.isoformat())
    else:
        log.info("order %s is paid, closed already, or gone: nothing to close", task.key)
    return None  # completed above: the worker records nothing more
