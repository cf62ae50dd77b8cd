"""CLI conventions: --lock-url on the group as on each command, the URL schemes listed once
(`mutexcron urls`), shell completion as documented, and `jobs FILE` pointing to `jobs list FILE`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from mutexcron.cli.main import main
from mutexcron.locks import SCHEMES, lock_store_from_url

pytestmark = pytest.mark.sqlite
CLI_DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def _used(url: str) -> str:
    store = lock_store_from_url(url)
    store.list()  # a node's first look creates the table
    store.close()
    return url


def test_lock_url_on_the_group_reaches_every_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    group = _used(f"sqlite:///{tmp_path}/group.db")
    own = _used(f"sqlite:///{tmp_path}/own.db")
    monkeypatch.setenv("MUTEXCRON_LOCK_URL", f"sqlite:///{tmp_path}/env.db")
    runner = CliRunner()
    for args in (["status"], ["history"], ["tasks", "list"], ["ddl"]):
        result = runner.invoke(main, ["--lock-url", group, *args])
        assert result.exit_code == 0, (args, result.output)
        assert "env.db" not in result.output, "the group's flag wins over the environment"
    assert "group.db" in runner.invoke(main, ["--lock-url", group, "status"]).output
    mine = runner.invoke(main, ["--lock-url", group, "status", "--lock-url", own])
    assert mine.exit_code == 0 and "own.db" in mine.output and "group.db" not in mine.output
    assert not (tmp_path / "env.db").exists()


def _commands(group: click.Group, ctx: click.Context) -> list[tuple[str, click.Command]]:
    found: list[tuple[str, click.Command]] = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None
        if isinstance(command, click.Group):
            found += [(f"{name} {sub}", c) for sub, c in _commands(command, ctx)]
        else:
            found.append((name, command))
    return found


def test_the_url_schemes_are_listed_once_by_mutexcron_urls() -> None:
    with click.Context(main) as ctx:
        commands = _commands(main, ctx)
    with_url = [(name, c) for name, c in commands if any(p.name == "lock_url" for p in c.params)]
    assert len(with_url) >= 15
    for name, command in with_url:
        text = " ".join(CliRunner().invoke(main, [*name.split(), "--help"]).output.split())
        assert "mutexcron urls" in text, name
        assert "redis+sentinel" not in text and "mongodb+srv" not in text, f"{name} --help repeats the schemes"
    listed = CliRunner().invoke(main, ["urls"])
    assert listed.exit_code == 0
    for scheme in SCHEMES:
        assert f"{scheme}://" in listed.output, scheme
    assert 'pip install "mutexcron[postgresql]"' in listed.output


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_shell_completion_works_as_documented(shell: str) -> None:
    docs = CLI_DOCS.read_text(encoding="utf-8")
    line = next((ln for ln in docs.splitlines() if f"_MUTEXCRON_COMPLETE={shell}_source" in ln), None)
    assert line is not None, f"docs/cli.md documents no completion for {shell}"
    command = Path(sys.executable).parent / "mutexcron"  # the console script: completion is keyed by its name
    if not command.exists():
        pytest.skip(f"no mutexcron console script beside {sys.executable} (pip install -e .)")
    script = subprocess.run(
        [str(command)], env={**os.environ, "_MUTEXCRON_COMPLETE": f"{shell}_source"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert script.returncode == 0 and re.search(r"_MUTEXCRON_COMPLETE|_mutexcron_completion", script.stdout), script


def test_jobs_with_a_file_where_the_verb_belongs_suggests_jobs_list(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.py"
    jobs.write_text("x = 1\n")
    result = CliRunner().invoke(main, ["jobs", str(jobs)])
    assert result.exit_code == 2
    assert f"to list its jobs, mutexcron jobs list {jobs}" in result.output
    typo = CliRunner().invoke(main, ["jobs", "lst"])
    assert typo.exit_code == 2 and "No such command 'lst'" in typo.output
