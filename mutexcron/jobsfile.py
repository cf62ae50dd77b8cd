"""Import a user's jobs file (``path/jobs.py``, ``path/jobs.py:sched`` or ``module:attr``): what
``mutexcron run``, ``mutexcron jobs`` and the dashboard's ``--jobs`` load."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from .errors import ConfigurationError, JobsFileError
from .scheduler import MutexSchedulerMixin

__all__ = ["load_scheduler"]


def load_scheduler(spec: str) -> MutexSchedulerMixin:
    """Import the jobs file named by ``spec`` and return its one MutexScheduler.

    Raises:
        JobsFileError: the file is missing, does not import, or has no (or several) schedulers;
            the message names the file and line.
    """
    target, attr = _split(spec)
    if target.endswith(".py") or os.sep in target or Path(target).is_file():
        module, filename = _import_file(Path(target)), str(Path(target))
    else:
        module, filename = _import_module(target), target
    if attr:
        obj = getattr(module, attr, None)
        if not isinstance(obj, MutexSchedulerMixin):
            raise JobsFileError(f"{attr!r} is not a MutexScheduler (it is {type(obj).__name__})", filename=filename)
        return obj
    found: dict[int, tuple[str, MutexSchedulerMixin]] = {}
    for name, value in vars(module).items():
        if isinstance(value, MutexSchedulerMixin):
            found.setdefault(id(value), (name, value))
    if not found:
        from .tasks.pool import TaskPool

        if any(isinstance(v, TaskPool) and v.handlers for v in vars(module).values()):
            raise JobsFileError(
                "task handlers are registered on a TaskPool, but no MutexScheduler runs them: write "
                "`sched = MutexScheduler()` and register them with `@sched.tasks.handler(...)`",
                filename=filename,
            )
        raise JobsFileError(
            "no MutexScheduler found: create one at module level, e.g. `sched = MutexScheduler()`", filename=filename
        )
    if len(found) > 1:
        names = ", ".join(sorted(n for n, _ in found.values()))
        raise JobsFileError(f"several MutexSchedulers ({names}): pick one with {spec}:NAME", filename=filename)
    return next(iter(found.values()))[1]


def _split(spec: str) -> tuple[str, str]:
    head, sep, tail = spec.rpartition(":")
    if sep and tail.isidentifier() and head and not (len(head) == 1 and head.isalpha()):  # not "C:\..."
        return head, tail
    return spec, ""


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise JobsFileError("jobs file not found (give a .py file path or module:attr)", filename=str(path))
    path = path.resolve()
    name = path.stem if path.stem.isidentifier() and path.stem not in sys.modules else f"mutexcron_jobs_{abs(hash(path))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise JobsFileError("cannot import this file as Python", filename=str(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))  # so the jobs file can import its neighbours
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(name, None)
        sys.path.remove(str(path.parent))
        raise _explain(exc, str(path)) from exc
    return module


def _import_module(name: str) -> ModuleType:
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            raise JobsFileError(f"no module named {exc.name!r} (a file path must end in .py)", filename=name) from exc
        raise _explain(exc, None) from exc
    except BaseException as exc:
        raise _explain(exc, None) from exc


def _explain(exc: BaseException, filename: str | None) -> JobsFileError:
    """Turn an import-time failure into 'file:line: problem'."""
    if isinstance(exc, SyntaxError):
        return JobsFileError(f"syntax error: {exc.msg}", filename=exc.filename or filename, lineno=exc.lineno)
    where: Any = None
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in frames:  # the deepest frame in the jobs file (or, for module:attr, outside mutexcron)
        in_target = filename is not None and os.path.abspath(frame.filename) == os.path.abspath(filename)
        outside = filename is None and "importlib" not in frame.filename and "/mutexcron/" not in frame.filename
        if in_target or outside:
            where = frame
    kind = "" if isinstance(exc, ConfigurationError) else f"{type(exc).__name__}: "
    if where is not None:
        return JobsFileError(f"{kind}{exc}", filename=where.filename, lineno=where.lineno)
    return JobsFileError(f"{kind}{exc}", filename=filename)
