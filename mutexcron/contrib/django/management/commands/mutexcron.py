"""``python manage.py mutexcron run [JOBS] [options]``: the ``mutexcron`` command inside this Django
project (settings loaded, locks in its database); ``JOBS`` defaults to ``settings.MUTEXCRON_JOBS``.
Every ``mutexcron`` subcommand works (``status``, ``jobs list``, ``trigger``...)."""

from __future__ import annotations

import argparse
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from .....cli.main import main as mutexcron_main
from ... import JOBS_SETTING


class Command(BaseCommand):  # type: ignore[misc]
    help = "Run mutexcron in this project: `manage.py mutexcron run` on every node (JOBS from settings.MUTEXCRON_JOBS)"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("argv", nargs=argparse.REMAINDER, help="the mutexcron command and its arguments")

    def handle(self, *args: Any, **options: Any) -> None:
        argv = list(options["argv"])
        if argv[:1] == ["run"] and not any(not a.startswith("-") for a in argv[1:]):
            jobs = getattr(settings, JOBS_SETTING, None)
            if not jobs:
                raise CommandError(f"give the jobs module (manage.py mutexcron run app.jobs:sched) or set {JOBS_SETTING}")
            argv.insert(1, str(jobs))
        mutexcron_main.main(args=argv, prog_name="manage.py mutexcron")
