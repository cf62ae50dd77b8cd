"""Every exception mutexcron raises, rooted at :class:`MutexcronError`."""

from __future__ import annotations


class MutexcronError(Exception):
    """Base class of every mutexcron error."""


class ConfigurationError(MutexcronError, ValueError):
    """Bad configuration: a URL, an option, a cron field, a missing driver.

    The message always says what to change.
    """


class JobsFileError(ConfigurationError):
    """The jobs file could not be found, imported or understood."""

    def __init__(self, message: str, *, filename: str | None = None, lineno: int | None = None) -> None:
        self.filename = filename
        self.lineno = lineno
        where = f"{filename}:{lineno}: " if filename and lineno else (f"{filename}: " if filename else "")
        super().__init__(f"{where}{message}")


class StoreError(MutexcronError):
    """The lock store failed in a way that is not a plain outage."""


class StoreUnavailableError(StoreError):
    """The lock store cannot be reached right now. Guarded jobs do not run until it can."""


class PartlyCompletedError(StoreUnavailableError):
    """A batch of task completions the store could not finish: ``ended`` holds the positions of
    the items it did record (committed before the failure), so that a retry leaves them out."""

    def __init__(self, message: str, ended: frozenset[int]) -> None:
        super().__init__(message)
        self.ended = ended


class SchemaMissingError(StoreError):
    """A read-only store (the dashboard's) found no table where the store keeps its records: no
    node has used this store yet, and a reader never creates one."""


class AttrsError(MutexcronError, TypeError):
    """Lock attrs that cannot be stored as JSON."""


class LeaseError(MutexcronError):
    """A lease operation was used outside the context that supports it."""


class StaleTaskError(MutexcronError):
    """A task's completion inside the caller's transaction was refused by its fence: this attempt no
    longer runs the task (its lease ran out and a newer attempt took it over, or it is gone).

    Raised by :meth:`mutexcron.tasks.handlers.Task.complete`. Let it propagate: your transaction
    rolls back with the writes of this stale attempt, and the worker records nothing more for it.
    """


class TaskSignal(MutexcronError):
    """Raised by a task handler to tell the worker what to record (not an error of the handler)."""


class Defer(TaskSignal):
    """Run the task again in ``seconds`` (its due and idempotency key kept), quietly: no traceback
    is logged. The attempt still counts toward the handler's ``max_attempts``."""

    def __init__(self, seconds: float, reason: str = "deferred") -> None:
        super().__init__(reason)
        self.seconds, self.reason = max(0.0, float(seconds)), reason


class FailTask(TaskSignal):
    """Keep the task as ``failed`` now with this error, whatever attempts are left."""
