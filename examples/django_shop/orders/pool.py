"""The task pool the web app adds tasks to, and the codes of the tasks it adds."""

from functools import cache

from django.conf import settings

from mutexcron import TaskPool

#: Closes an order that is still unpaid when its payment window ends. Key: the order's id.
CLOSE_UNPAID_ORDER = "close_unpaid_order"


@cache
def task_pool() -> TaskPool:
    """One pool per process, built on first use (Django's settings are loaded by then).

    A producer needs no scheduler: the nodes that run ``mutexcron run orders/jobs.py`` claim the
    tasks from the same store.
    """
    return TaskPool(settings.MUTEXCRON_LOCK_URL)
