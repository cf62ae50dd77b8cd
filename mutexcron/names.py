"""The one rule for lock names and job ids, which become keys in every store, and the one escape
for names and other outside text shown in a log line or on a terminal."""

from __future__ import annotations

import unicodedata

from .errors import ConfigurationError

#: The longest name every store holds (the SQL ``name`` column is VARCHAR(191)).
MAX_NAME_LENGTH = 191
#: Locks mutexcron takes for its own work (the task pruner): they guard no job of yours.
INTERNAL_LOCK_PREFIX = "mutexcron:"


def check_name(name: object, what: str) -> str:
    """Return ``name`` if it is a valid lock name or job id, else raise ConfigurationError.

    Valid: a non-empty string of at most 191 characters with no control characters (NUL, newline,
    tab...) and no lone surrogates (no store can encode them). ``what`` says whose name it is, e.g.
    ``"lock name of job 'report'"``.
    """
    rule = f"a non-empty string of at most {MAX_NAME_LENGTH} characters without control characters"
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"bad {what} {name!r}: it must be {rule}")
    if len(name) > MAX_NAME_LENGTH:
        raise ConfigurationError(f"bad {what} {name[:40]!r}... ({len(name)} characters): it must be {rule}")
    bad = sorted({c for c in name if unicodedata.category(c) == "Cc"})
    if bad:
        shown = ", ".join(f"U+{ord(c):04X}" for c in bad)
        raise ConfigurationError(f"bad {what} {name!r}: it contains the control character(s) {shown}; it must be {rule}")
    lone = sorted({c for c in name if unicodedata.category(c) == "Cs"})
    if lone:  # no store can write it: UTF-8 has no encoding for half a surrogate pair
        shown = ", ".join(f"U+{ord(c):04X}" for c in lone)
        raise ConfigurationError(
            f"bad {what} {name!r}: it contains the lone surrogate(s) {shown}, which no store can encode (text decoded "
            "with errors='surrogateescape' or a broken pair); decode it properly or drop those characters"
        )
    return name


def printable(text: object) -> str:
    """``text`` safe for one log or terminal line: every non-printable character (a newline, a
    terminal escape, a NUL...) is shown as its escape (``\\n``, ``\\x1b``), so outside text such as
    ``pause --by`` can never forge a line or drive a terminal."""
    shown = str(text)
    if shown.isprintable():
        return shown
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in shown)
