"""A producer: add, update, cancel and look at tasks that examples/delayed_tasks.py runs.

    python examples/add_tasks.py          # due in hours and days, as in production
    python examples/add_tasks.py --now    # due now: a running `mutexcron run examples/delayed_tasks.py` takes them

A producer needs no scheduler: ``TaskPool(url)`` on the store the nodes use. The URL comes from
``MUTEXCRON_LOCK_URL`` (default ``sqlite:///mutexcron.db``, the nodes' default too).
"""

import argparse
import os
from datetime import datetime, timedelta, timezone

from mutexcron import TaskPool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--now", action="store_true", help="make the tasks due now instead of later")
    args = parser.parse_args()
    url = os.environ.get("MUTEXCRON_LOCK_URL", "sqlite:///mutexcron.db")

    with TaskPool(url) as pool:
        print(f"task store: {pool.masked_url}")

        def due(later):
            return timedelta(0) if args.now else later  # timedelta(0): due now, by the store's clock

        # A timedelta is measured from the STORE's clock when the task is written: no host clock involved.
        result = pool.add("end_promotion", "sku-123", due(timedelta(days=3)), payload={"pct": 20})
        print(f"end_promotion/sku-123: {result}")  # inserted (replaced if it existed)

        # (code, key) is the task's identity: adding it again updates it. on_conflict="earliest"
        # keeps whichever due comes first, so a later due changes nothing ("kept").
        result = pool.add("end_promotion", "sku-123", timedelta(days=7), payload={"pct": 20}, on_conflict="earliest")
        print(f"end_promotion/sku-123 again, 7 days, earliest: {result}")

        # An aware datetime is an absolute due. A naive one is refused (ConfigurationError).
        tomorrow_8am = (datetime.now(timezone.utc) + timedelta(days=1)).replace(hour=8, minute=0, second=0, microsecond=0)
        result = pool.add("charge_invoice", "inv-1001", due(tomorrow_8am), payload={"amount_cents": 1999})
        print(f"charge_invoice/inv-1001: {result}")

        until = (datetime.now(timezone.utc) + timedelta(days=1)).isoformat(timespec="seconds")
        payload = {"text": "your cart is waiting", "every": 4 * 3600, "until": until}
        result = pool.add("send_reminder", "user-42", due(timedelta(hours=1)), payload=payload)
        print(f"send_reminder/user-42: {result}")

        # Cancel: the task is dropped (a running one when its attempt ends). False: no such task.
        pool.add("end_promotion", "sku-999", timedelta(days=1), payload={"pct": 10})
        print(f"cancel end_promotion/sku-999: {pool.cancel('end_promotion', 'sku-999')}")
        print(f"cancel end_promotion/sku-999 again: {pool.cancel('end_promotion', 'sku-999')}")

        task = pool.get("end_promotion", "sku-123")
        if task is not None:
            print(f"get end_promotion/sku-123: {task.state}, due {task.due.isoformat()}, payload {task.payload}")

        print("list(code='end_promotion'):")
        for task in pool.list(code="end_promotion"):
            print(f"  {task.code}/{task.key} {task.state} due {task.due.isoformat()} attempt {task.attempt}")
        print("list():")
        for task in pool.list():
            print(f"  {task.code}/{task.key} {task.state} due {task.due.isoformat()}")


if __name__ == "__main__":
    main()
