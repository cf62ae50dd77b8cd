"""``python -m mutexcron``: the same as the ``mutexcron`` command."""

from .cli.main import main

main()
