"""The test Django project's manage.py (tests/test_contrib_django.py): its database from $DJ_DATABASE."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cluster_project.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
