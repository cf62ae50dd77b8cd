"""The loader: a jobs file by path, path:NAME or module:attr, and its errors with file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from mutexcron import AsyncIOMutexScheduler, JobsFileError, MutexScheduler
from mutexcron.cli.loader import load_scheduler

pytestmark = pytest.mark.memory

ONE = "from mutexcron import MutexScheduler\nsched = MutexScheduler(lock_url='memory://loader')\n"


def write(tmp_path: Path, body: str, name: str = "jobs.py") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def test_a_path_gives_its_one_scheduler(tmp_path: Path) -> None:
    sched = load_scheduler(str(write(tmp_path, ONE)))
    assert isinstance(sched, MutexScheduler) and sched.lock_url == "memory://loader"


def test_path_colon_name_picks_one_of_several(tmp_path: Path) -> None:
    body = ONE + "other = MutexScheduler(lock_url='memory://other')\n"
    path = write(tmp_path, body)
    assert load_scheduler(f"{path}:other").lock_url == "memory://other"
    with pytest.raises(JobsFileError, match=r"several MutexSchedulers \(other, sched\)"):
        load_scheduler(str(path))


def test_module_colon_attr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, ONE, "loader_mod.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert isinstance(load_scheduler("loader_mod:sched"), MutexScheduler)


def test_the_asyncio_flavour_loads_too(tmp_path: Path) -> None:
    body = "from mutexcron import AsyncIOMutexScheduler\nsched = AsyncIOMutexScheduler(lock_url='memory://aio')\n"
    assert isinstance(load_scheduler(str(write(tmp_path, body))), AsyncIOMutexScheduler)


@pytest.mark.parametrize(
    ("body", "line", "problem"),
    [
        ("x = 1\ndef broken(:\n    pass\n", 2, "syntax error"),
        ("import os\nraise RuntimeError('boom')\n", 2, "boom"),
        ("import not_a_module_anywhere\n", 1, "not_a_module_anywhere"),
    ],
)
def test_errors_name_the_file_and_line(tmp_path: Path, body: str, line: int, problem: str) -> None:
    path = write(tmp_path, body)
    with pytest.raises(JobsFileError) as info:
        load_scheduler(str(path))
    assert info.value.filename is not None and info.value.filename.endswith("jobs.py")
    assert info.value.lineno == line
    assert problem in str(info.value)


def test_missing_file_and_no_scheduler(tmp_path: Path) -> None:
    with pytest.raises(JobsFileError, match="not found"):
        load_scheduler(str(tmp_path / "absent.py"))
    with pytest.raises(JobsFileError, match="no MutexScheduler found"):
        load_scheduler(str(write(tmp_path, "x = 1\n")))
    with pytest.raises(JobsFileError, match="is not a MutexScheduler"):
        named = write(tmp_path, ONE + "y = 2\n", "named.py")
        load_scheduler(f"{named}:y")


def test_handlers_on_a_bare_task_pool_say_how_to_run_them(tmp_path: Path) -> None:
    body = (
        f"from mutexcron import TaskPool\npool = TaskPool('sqlite:///{tmp_path}/t.db')\n"
        "@pool.handler('c')\ndef handle(task):\n    pass\n"
    )
    with pytest.raises(JobsFileError, match=r"no MutexScheduler runs them: .*@sched.tasks.handler"):
        load_scheduler(str(write(tmp_path, body, "pool_only.py")))


def test_an_import_error_names_the_innermost_line_of_the_users_code(tmp_path: Path) -> None:
    """deep.py imports helper.py, whose line 4 raises: the error is at helper.py:4, not deep.py:1."""
    write(tmp_path, "import os\n\n\nDATABASE_URL = os.environ['MUTEXCRON_TEST_NO_SUCH_VARIABLE']\n", "loader_helper.py")
    path = write(tmp_path, "from loader_helper import DATABASE_URL\n" + ONE, "deep.py")
    with pytest.raises(JobsFileError) as info:
        load_scheduler(str(path))
    assert info.value.filename is not None and info.value.filename.endswith("loader_helper.py")
    assert info.value.lineno == 4
    message = str(info.value)
    assert "loader_helper.py:4: KeyError: 'MUTEXCRON_TEST_NO_SUCH_VARIABLE'" in message
    assert f"(imported from {path}:1)" in message and "--log-level debug shows the traceback" in message
