"""Settings of the shop example: one app (orders), SQLite, and the mutexcron task store's URL.

The task pool lives in the same SQLite file as the orders (table ``mutexcron_tasks``, created by
the migration ``orders/migrations/0002_mutexcron_tasks.py``). With PostgreSQL or MySQL, point
``DATABASES`` and ``MUTEXCRON_LOCK_URL`` at the same database (or any other: the task store does
not need to be Django's database).

Environment variables (all optional): ``SHOP_DB_PATH`` (the SQLite file), ``MUTEXCRON_LOCK_URL``
(the task store, default: that file), ``SHOP_PAYMENT_WINDOW_SECONDS`` (default 1800: 30 minutes).
"""

import os
from datetime import timedelta
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "django-insecure-example-only-do-not-deploy")
DEBUG = True
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "[::1]", "testserver"]

INSTALLED_APPS = ["orders"]
MIDDLEWARE = ["django.middleware.common.CommonMiddleware"]
ROOT_URLCONF = "shop.urls"
WSGI_APPLICATION = "shop.wsgi.application"

DB_PATH = Path(os.environ.get("SHOP_DB_PATH") or BASE_DIR / "db.sqlite3").resolve()
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": DB_PATH,
        "OPTIONS": {"timeout": 20},  # seconds to wait for the file's write lock (the workers write too)
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"

# The store the web app adds tasks to and the nodes (`mutexcron run orders/jobs.py`) claim them
# from: sqlite:////absolute/path/db.sqlite3 by default, the same file as the orders.
MUTEXCRON_LOCK_URL = os.environ.get("MUTEXCRON_LOCK_URL") or f"sqlite:///{DB_PATH}"
# How long an order waits for its payment before close_unpaid_order closes it.
ORDER_PAYMENT_WINDOW = timedelta(seconds=float(os.environ.get("SHOP_PAYMENT_WINDOW_SECONDS", 30 * 60)))
