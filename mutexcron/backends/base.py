"""The backend interface: one connection to one store, shared by the stores built on it.

A backend is built from a store URL and owns everything about the store that is not a lock (or,
later, a task): the driver's client or engine and the URL's options, the store's clock (SQL
expressions, Redis ``TIME``, MongoDB ``$$NOW``), the translation of driver errors, the redaction
of driver messages, and ``close()``. Lock stores in :mod:`mutexcron.locks` hold only their own
statements or scripts and their record parsing.

Every store error reads the same way, whatever the store::

    <Kind> store <masked URL>: unavailable during <operation>: <driver detail>    StoreUnavailableError
    <Kind> store <masked URL>: <operation> failed: <driver detail>                StoreError

The driver detail is the exception's type and the first line of its message, with every secret
of the URL removed (:func:`mutexcron.urls.redact`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from ..errors import StoreError, StoreUnavailableError
from ..urls import mask_url, redact

_Store = TypeVar("_Store")

#: The longest driver detail an error message quotes (some drivers describe a whole topology).
DETAIL_LIMIT = 500


class UncertainOutcome(Exception):
    """A write met contention, or its outcome is unknown: it may or may not have been applied.

    Backends raise it (from the driver's error); stores report an acquire as *uncertain* and turn
    any other write into StoreUnavailableError with :meth:`Backend.uncertain`: never a success,
    never a refusal.
    """

    def __init__(self, operation: str, reason: str) -> None:
        super().__init__(f"{operation}: {reason}")
        self.operation = operation
        self.reason = reason


class Backend(ABC):
    """One store, reached through its driver: built from a URL, closed with :meth:`close`.

    Subclasses set :attr:`kind` and :attr:`driver_errors`, decide which driver errors are
    outages (:meth:`is_unavailable`), and may refine :meth:`error` and :meth:`detail`.
    """

    #: The store's name in messages: "SQLite", "PostgreSQL", "Redis", "MongoDB"...
    kind: str = "?"
    #: The driver exceptions :meth:`errors` translates.
    driver_errors: tuple[type[BaseException], ...] = ()

    def __init__(self, url: str) -> None:
        self.url = url
        #: A reader that must not write (the dashboard): the stores create no table, index or
        #: collection and fill no index on a read (SQL: a missing table is :class:`SchemaMissingError`).
        self.read_only = False

    @property
    def masked_url(self) -> str:
        """The URL with any password replaced by ``***``: safe for logs and ``status``."""
        return mask_url(self.url)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.masked_url!r})"

    # -- errors ------------------------------------------------------------------------------
    def redact(self, text: str) -> str:
        """``text`` without any secret of the URL (belt and braces: drivers rarely quote them)."""
        return redact(text, self.url)

    def detail(self, exc: BaseException) -> str:
        """What the driver said: the exception's type and first line, redacted, at most :data:`DETAIL_LIMIT` long."""
        lines = str(exc).strip().splitlines()
        text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        return self.redact(text)[:DETAIL_LIMIT]  # redacted first, so a cut never leaves half a secret

    def unavailable(self, exc: BaseException, operation: str) -> StoreUnavailableError:
        """The store cannot be reached (or cannot say what happened): guarded jobs wait."""
        return StoreUnavailableError(f"{self.kind} store {self.masked_url}: unavailable during {operation}: {self.detail(exc)}")

    def failed(self, exc: BaseException | None, operation: str, why: str | None = None) -> StoreError:
        """The store answered, and refused or failed the request: retrying the same request cannot help.

        Args:
            exc: the driver's error (its :meth:`detail` is quoted unless ``why`` is given).
            operation: what the store was asked to do.
            why: the reason in mutexcron's words, instead of the driver's.
        """
        reason = why if why is not None else self.detail(exc) if exc is not None else "no detail"
        return StoreError(f"{self.kind} store {self.masked_url}: {operation} failed: {reason}")

    def uncertain(self, outcome: UncertainOutcome) -> StoreUnavailableError:
        """A write that is neither done nor refused (contention, unknown outcome): the caller retries."""
        cause = outcome.__cause__ or outcome
        return self.unavailable(cause, f"{outcome.operation} ({outcome.reason})")

    def is_unavailable(self, exc: BaseException) -> bool:
        """True if ``exc`` says the store cannot be reached (down, restarting, partitioned, failing over)."""
        return False

    def error(self, exc: BaseException, operation: str) -> StoreError:
        """The one translation of a driver error: StoreUnavailableError for an outage, else StoreError."""
        return self.unavailable(exc, operation) if self.is_unavailable(exc) else self.failed(exc, operation)

    @contextmanager
    def errors(self, operation: str) -> Iterator[None]:
        """Translate the driver's errors raised in the block with :meth:`error`."""
        try:
            yield
        except self.driver_errors as exc:
            raise self.error(exc, operation) from exc

    # -- life cycle --------------------------------------------------------------------------
    @abstractmethod
    def ping(self) -> None:
        """One raw round trip to the server (``SELECT 1``, ``PING``...)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. The backend (and every store on it) must not be used afterwards."""


def reading_only(store: _Store) -> _Store:
    """``store`` with its backend made read-only (:attr:`Backend.read_only`): a read creates no file,
    table, index or collection (the dashboard, ``status``, ``history``, ``tasks list``...)."""
    backend = getattr(store, "backend", None)
    if isinstance(backend, Backend):
        backend.read_only = True
    return store
