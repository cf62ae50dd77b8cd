"""The documentation as rendered: no list read as a paragraph, no block inside a paragraph.

The check itself runs on every page in CI after ``mkdocs build`` (``.ci/run``); here it is tested
on samples, and run on a fresh build where mkdocs is installed (``pip install -e ".[docs]"``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_html import check_site, problems

ROOT = Path(__file__).resolve().parents[1]


def test_a_list_read_as_a_paragraph_and_a_block_inside_one_are_found() -> None:
    run_on = "<li><p>run</p>\n<p><div class='highlight'><pre>x</pre></div>\n* <strong>ddl</strong> prints</p></li>"
    assert [p.split(":")[0] for p in problems(run_on)] == ["a block inside a paragraph"]
    assert problems("<p>The other outcomes: x\n  * <strong>tasks cancel</strong> drops</p>")
    assert problems("<p>- a dash item</p>")
    assert not problems("<p>a <code>*</code> and a - minus, x * y</p><ul><li>item</li></ul>")
    assert not problems("<p>text</p><pre><code>* not markdown\n</code></pre>")


def test_every_page_renders_its_lists(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    site = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    assert check_site(site) == []
