"""JSON views: create an order (its close_unpaid_order task is added in the same transaction), pay it
(the task is cancelled in the same transaction).

They are csrf_exempt only so the README's curl commands work: keep CSRF protection in a real app.
"""

import json
import logging

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.http import HttpRequest, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from mutexcron import MutexcronError

from .models import Order
from .pool import CLOSE_UNPAID_ORDER, task_pool

log = logging.getLogger(__name__)


def _order_json(order: Order) -> dict:
    return {"id": order.pk, "amount_cents": order.amount_cents, "status": order.status}


@csrf_exempt
@require_POST
def create_order(request: HttpRequest) -> JsonResponse:
    """POST {"amount_cents": 1999}: the order, and a task that closes it if still unpaid in 30 minutes."""
    try:
        amount = int(json.loads(request.body or b"{}").get("amount_cents", 0))
    except (ValueError, TypeError, AttributeError):
        amount = 0
    if amount <= 0:
        return JsonResponse({"error": 'send {"amount_cents": <a positive integer>}'}, status=400)
    try:
        # The order and its closing task in one transaction: both commit, or neither does. The task
        # store is Django's own database (settings.MUTEXCRON_LOCK_URL), and `transaction=connection`
        # writes the task on this request's connection, inside this atomic block.
        with transaction.atomic():
            order = Order.objects.create(amount_cents=amount)
            # Key = the order's id: (code, key) is the task's identity, so adding it again would move
            # this order's one task rather than add a second. A timedelta due is counted from the
            # database's clock, so the web servers' clocks do not matter.
            result = task_pool().add(
                CLOSE_UNPAID_ORDER,
                str(order.pk),
                settings.ORDER_PAYMENT_WINDOW,
                payload={"amount_cents": amount},
                transaction=connection,
            )
    except (MutexcronError, DatabaseError) as exc:
        log.error("order not created: the database is unavailable (%s)", exc)  # rolled back: no order, no task
        return JsonResponse({"error": "the database is unavailable: try again"}, status=503)
    return JsonResponse({**_order_json(order), "close_task": str(result)}, status=201)


@require_GET
def order_detail(request: HttpRequest, pk: int) -> JsonResponse:
    """The order and its pending close_unpaid_order task, if any."""
    order = Order.objects.filter(pk=pk).first()
    if order is None:
        return JsonResponse({"error": f"no order {pk}"}, status=404)
    task = task_pool().get(CLOSE_UNPAID_ORDER, str(pk))
    close_task = None if task is None else {"state": task.state, "due": task.due.isoformat(), "attempt": task.attempt}
    return JsonResponse({**_order_json(order), "close_task": close_task})


@csrf_exempt
@require_POST
def pay_order(request: HttpRequest, pk: int) -> JsonResponse:
    """Mark the order paid (only if it is still unpaid) and cancel its close_unpaid_order task."""
    with transaction.atomic():  # the payment and the cancel of the close task commit together
        paid = Order.objects.filter(pk=pk, status=Order.Status.UNPAID).update(status=Order.Status.PAID, paid_at=timezone.now())
        cancelled = paid > 0 and task_pool().cancel(CLOSE_UNPAID_ORDER, str(pk), transaction=connection)
    order = Order.objects.filter(pk=pk).first()
    if order is None:
        return JsonResponse({"error": f"no order {pk}"}, status=404)
    if not paid:
        return JsonResponse({**_order_json(order), "error": f"order {pk} is {order.status}, not unpaid"}, status=409)
    return JsonResponse({**_order_json(order), "close_task_cancelled": cancelled})
