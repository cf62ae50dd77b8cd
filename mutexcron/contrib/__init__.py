"""Integrations with the frameworks APScheduler users already run: Flask-APScheduler (``flask``) and
django-apscheduler (``django``). Each imports its framework lazily, on first import of its module."""
