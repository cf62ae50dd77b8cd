"""URL helpers shared by the CLI and the stores."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode

# scheme://user:password@host  ->  scheme://user:***@host   (also for comma-separated host lists)
_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^:@/]*):(?P<password>[^@/]*)@")
_SECRET_PARAMS = {"password", "passwd", "pwd", "secret", "token", "ssl_password", "sslpassword", "tlscertificatekeyfilepassword"}


def mask_url(url: str) -> str:
    """Hide the password (and password-like query parameters) of a URL: safe to print or log."""
    masked = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", url, count=1)
    if "?" in masked:
        base, _, query = masked.partition("?")
        pairs = [(k, "***" if k.lower() in _SECRET_PARAMS else v) for k, v in parse_qsl(query, keep_blank_values=True)]
        masked = f"{base}?{urlencode(pairs, safe='*/:,')}"
    return masked


def redact(text: str, url: str) -> str:
    """``text`` (e.g. a driver's error message) with the password of ``url`` replaced by ``***``."""
    match = _USERINFO.match(url)
    if match and match["password"]:
        from urllib.parse import unquote

        for secret in {match["password"], unquote(match["password"])}:
            if len(secret) >= 2:
                text = text.replace(secret, "***")
    return text


def url_scheme(url: str) -> str:
    """The lower-cased scheme of ``url`` ('' if it has none)."""
    head, sep, _ = url.partition("://")
    return head.lower() if sep else ""


def pop_query(url: str, *names: str) -> tuple[str, dict[str, str]]:
    """Remove mutexcron's own query options from a URL; return the rest and the options.

    The URL is split by hand (not by urlsplit) so ``sqlite:////abs/path`` keeps its slashes.
    """
    base, sep, query = url.partition("?")
    if not sep:
        return url, {}
    kept: list[tuple[str, str]] = []
    found: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key in names:
            found[key] = value
        else:
            kept.append((key, value))
    return (f"{base}?{urlencode(kept)}" if kept else base), found
