"""``python manage.py mutexcron run [JOBS] [options]``: the ``mutexcron`` command inside this Django
project (settings loaded, locks in its database). Every ``mutexcron`` subcommand works (``status``,
``trigger``, ``history``...); where one takes the jobs module (``run``, ``jobs list|show|pause|...``)
and it is left out, ``settings.MUTEXCRON_JOBS`` is put in its place."""

from __future__ import annotations

import argparse
from typing import Any

import click
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from .....cli.main import main as mutexcron_main
from ... import JOBS_SETTING

#: The name of the jobs-module argument of the commands that take one.
JOBS_ARGUMENTS = ("jobs", "jobs_file")


class Command(BaseCommand):  # type: ignore[misc]
    help = "Run mutexcron in this project: `manage.py mutexcron run` on every node (JOBS from settings.MUTEXCRON_JOBS)"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("argv", nargs=argparse.REMAINDER, help="the mutexcron command and its arguments")

    def handle(self, *args: Any, **options: Any) -> None:
        mutexcron_main.main(args=with_jobs_module(list(options["argv"])), prog_name="manage.py mutexcron")


def with_jobs_module(argv: list[str]) -> list[str]:
    """``argv`` with ``settings.MUTEXCRON_JOBS`` put in where a command's jobs module is missing."""
    command: click.Command = mutexcron_main
    depth = 0
    while isinstance(command, click.Group) and depth < len(argv) and argv[depth] in command.commands:
        command, depth = command.commands[argv[depth]], depth + 1
    arguments = [p for p in command.params if isinstance(p, click.Argument)]
    if depth == 0 or not arguments or arguments[0].name not in JOBS_ARGUMENTS:
        return argv
    if len(_positionals(command, argv[depth:])) >= len(arguments):
        return argv
    jobs = getattr(settings, JOBS_SETTING, None)
    if not jobs:
        shown = " ".join(argv[:depth])
        raise CommandError(f"give the jobs module (manage.py mutexcron {shown} app.jobs:sched) or set {JOBS_SETTING}")
    return [*argv[:depth], str(jobs), *argv[depth:]]


def _positionals(command: click.Command, args: list[str]) -> list[str]:
    """The arguments of ``args`` that are not options nor their values."""
    takes_value = {name for p in command.params if isinstance(p, click.Option) and not p.is_flag for name in p.opts}
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in takes_value
        else:
            out.append(arg)
    return out
