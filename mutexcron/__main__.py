"""``python -m mutexcron``: the same as the ``mutexcron`` command."""

from .cli import main

main()
