"""Django settings for django-apscheduler's test suite (tests/test_django_apscheduler_suite.py):
SQLite, its test database in memory."""

SECRET_KEY = "tests-only"
CONTRIB_APPS = ("admin", "auth", "contenttypes", "sessions", "messages")
INSTALLED_APPS = [*(f"django.contrib.{app}" for app in CONTRIB_APPS), "django_apscheduler"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
APSCHEDULER_RUN_NOW_TIMEOUT = 15
