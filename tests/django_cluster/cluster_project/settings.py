"""A Django project with django-apscheduler and mutexcron.contrib.django; the database is
``$DJ_DATABASE`` (a ``DATABASES["default"]`` as JSON). Tests only."""

import json
import os

if json.loads(os.environ["DJ_DATABASE"])["ENGINE"].endswith("mysql"):
    import pymysql

    pymysql.install_as_MySQLdb()  # PyMySQL standing in for mysqlclient

SECRET_KEY = "tests-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_apscheduler",
    "mutexcron.contrib.django",  # after django_apscheduler: its admin replaces the job admin
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
ROOT_URLCONF = "cluster_project.urls"
DATABASES = {"default": json.loads(os.environ["DJ_DATABASE"])}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
MUTEXCRON_JOBS = "cluster_app.jobs:sched"
APSCHEDULER_RUN_NOW_TIMEOUT = 20
