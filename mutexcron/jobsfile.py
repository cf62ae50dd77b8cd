"""Import a user's jobs file (``path/jobs.py``, ``path/jobs.py:sched`` or ``module:attr``): what
``mutexcron run``, ``mutexcron jobs`` and the dashboard's ``--jobs`` load."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import sysconfig
import traceback
from pathlib import Path
from types import ModuleType

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


#: Hint after an import error: where its traceback is.
DEBUG_HINT = " (--log-level debug shows the traceback)"


def _explain(exc: BaseException, filename: str | None) -> JobsFileError:
    """Turn an import-time failure into 'file:line: problem', naming the innermost line of the
    user's code (a module the jobs file imports, if the error is there)."""
    if isinstance(exc, SyntaxError):
        return JobsFileError(f"syntax error: {exc.msg}", filename=exc.filename or filename, lineno=exc.lineno)
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if _is_users(frame.filename)]
    kind = "" if isinstance(exc, ConfigurationError) else f"{type(exc).__name__}: "
    if not frames:
        return JobsFileError(f"{kind}{exc}{DEBUG_HINT}", filename=filename)
    where, outer = frames[-1], frames[0]
    via = ""
    if len(frames) > 1 and os.path.abspath(outer.filename) != os.path.abspath(where.filename):
        via = f" (imported from {outer.filename}:{outer.lineno})"
    return JobsFileError(f"{kind}{exc}{via}{DEBUG_HINT}", filename=where.filename, lineno=where.lineno)


def _is_users(filename: str) -> bool:
    """True for a file of the user's code: not Python's own, an installed package's or mutexcron's."""
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return False
    path = os.path.abspath(filename)
    return not any(path.startswith(root + os.sep) for root in _not_users())


@functools.cache
def _not_users() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib") if name in paths}
    roots.add(os.path.dirname(os.path.abspath(__file__)))  # mutexcron itself
    return tuple(sorted(os.path.abspath(root) for root in roots))
