"""Checks of the rendered documentation site (``mkdocs build``), run by CI after the build and by
``tests/test_docs_rendered.py``: a strict build passes markdown that renders wrong.

* **A run-on list:** a paragraph with a line starting with ``* `` or ``- `` (a list that Markdown
  read as text, e.g. after a fenced block inside a list item).
* **A block inside a paragraph:** ``<p>`` holding a ``<div>`` or ``<pre>`` (the same cause).

``python -m tests.docs_html SITE_DIR`` prints each problem and exits 1 if there is one.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_PARAGRAPH = re.compile(r"<p>(.*?)</p>", re.S)
_PRE = re.compile(r"<pre\b.*?</pre>", re.S)
_LIST_LINE = re.compile(r"(?:^|\n)\s*[*-] \S")


def problems(html: str) -> list[str]:
    """What renders wrong in one page: a short quote of each bad paragraph."""
    found = []
    for match in _PARAGRAPH.finditer(html):
        text = match.group(1)
        if "<div" in text or "<pre" in text:
            found.append(f"a block inside a paragraph: {text[:80]!r}")
        elif _LIST_LINE.search(_PRE.sub("", text)):
            found.append(f"a list rendered as a paragraph: {text[:80]!r}")
    return found


def check_site(site: Path) -> list[str]:
    """Every problem of every page of a built site, as ``page: problem``."""
    return [
        f"{page.relative_to(site)}: {problem}"
        for page in sorted(site.rglob("*.html"))
        for problem in problems(page.read_text(encoding="utf-8"))
    ]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.docs_html SITE_DIR", file=sys.stderr)
        return 2
    found = check_site(Path(argv[0]))
    for line in found:
        print(f"docs: {line}", file=sys.stderr)
    print(f"docs: {len(found)} rendering problem(s) in {argv[0]}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
