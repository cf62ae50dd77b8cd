"""The ``mutexcron`` command: the click group and one module per command family, with their shared helpers."""
