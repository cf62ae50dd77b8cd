"""Settings of the django-apscheduler example: django-apscheduler and ``mutexcron.contrib.django``
installed, the jobs module named in ``MUTEXCRON_JOBS``. The locks and tasks go in
``DATABASES["default"]`` (the app sets that up), SQLite here: ``db.sqlite3`` beside manage.py.

``SITE_DATABASE`` (tests only): a ``DATABASES["default"]`` entry as JSON (PostgreSQL, MariaDB).
"""

import json
import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
DATABASE = json.loads(os.environ.get("SITE_DATABASE") or "null") or {
    "ENGINE": "django.db.backends.sqlite3", "NAME": str(BASE_DIR / "db.sqlite3"),
}  # fmt: skip
if DATABASE["ENGINE"].endswith("mysql"):
    import pymysql

    pymysql.install_as_MySQLdb()  # PyMySQL standing in for mysqlclient

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "django-insecure-example-only-do-not-deploy")
DEBUG = False
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_apscheduler",
    "mutexcron.contrib.django",  # after django_apscheduler: its admin's "run selected jobs" goes through the cluster
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]  # fmt: skip
ROOT_URLCONF = "site_settings.urls"
DATABASES = {"default": DATABASE}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
MUTEXCRON_JOBS = "reports.jobs:sched"  # what `python manage.py mutexcron run` runs
APSCHEDULER_RUN_NOW_TIMEOUT = 20  # the admin's "run selected jobs" waits this long for the holder's run
