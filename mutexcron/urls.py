"""URL helpers shared by the CLI and the stores, including the one secret-masking function.

Every log line, error message and ``status`` line that shows a store URL goes through
:func:`mask_url`, and every driver message that may quote a URL or a password goes through
:func:`redact`. Both take the user-info part of ``scheme://user:password@hosts/...`` as
everything up to the **last** ``@`` of the authority, as the drivers do, so a password with an
unescaped ``/``, ``@``, ``:`` or ``?`` is still hidden whole. When the URL cannot be split
with confidence, the whole user-info part is hidden.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, quote, unquote, urlencode

_SECRET_PARAMS = {
    "password",
    "passwd",
    "pwd",
    "secret",
    "token",
    "ssl_password",
    "sslpassword",
    "tlscertificatekeyfilepassword",
}
_MASK = "***"


def _split(url: str) -> tuple[str, str | None, str]:
    """``url`` -> (``scheme://``, user-info or None, the rest after the ``@``)."""
    scheme, sep, rest = url.partition("://")
    if not sep or rest.startswith("/"):  # no authority (sqlite:///path) or not a URL at all
        return "", None, url
    at = rest.rfind("@")
    if at < 0:
        return scheme + sep, None, rest
    return scheme + sep, rest[:at], rest[at + 1 :]


def _user_and_password(userinfo: str) -> tuple[str | None, str | None]:
    """(user, password) of a user-info part; user None if it cannot be told apart from a secret."""
    user, colon, password = userinfo.partition(":")
    if any(c in user for c in "/?#@"):  # not a plain user name: the split is doubtful
        return None, userinfo
    return user, (password if colon else None)


def mask_url(url: str) -> str:
    """Hide the password (and password-like query parameters) of a URL: safe to print or log."""
    head, userinfo, rest = _split(url)
    if userinfo is not None:
        user, password = _user_and_password(userinfo)
        if user is None:
            userinfo = _MASK
        elif password is not None:
            userinfo = f"{user}:{_MASK}"
        url = f"{head}{userinfo}@{rest}"
    if "?" in url:
        base, _, query = url.partition("?")
        pairs = [(k, _MASK if k.lower() in _SECRET_PARAMS else v) for k, v in parse_qsl(query, keep_blank_values=True)]
        url = f"{base}?{urlencode(pairs, safe='*/:,')}"
    return url


def mask_path(url: str) -> str:
    """A URL whose path is itself the secret (a monitor's ping URL, ``https://hc-ping.com/<uuid>``,
    ``https://cronitor.link/p/<api-key>/<job>``), safe to log: the scheme and host are kept (any
    password masked as by :func:`mask_url`); the path and query become ``/***``."""
    head, userinfo, rest = _split(url)
    if not head:  # not scheme://host...: nothing can be told apart from a secret
        return _MASK
    end = min([i for i in (rest.find(c) for c in "/?#") if i >= 0], default=len(rest))
    authority = mask_url(f"{head}{'' if userinfo is None else userinfo + '@'}{rest[:end]}")
    return authority + (f"/{_MASK}" if rest[end:].strip("/") else "")


def url_secrets(url: str) -> set[str]:
    """The secret strings of ``url`` (password, secret query values), raw and decoded."""
    found: set[str] = set()
    _head, userinfo, _rest = _split(url)
    if userinfo is not None:
        _user, password = _user_and_password(userinfo)
        if password:
            found.add(password)
    if "?" in url:
        for key, value in parse_qsl(url.partition("?")[2], keep_blank_values=True):
            if key.lower() in _SECRET_PARAMS and value:
                found.add(value)
    variants = set()
    for secret in found:
        variants |= {secret, unquote(secret), quote(unquote(secret), safe="")}
    return {s for s in variants if len(s) >= 2}


def redact(text: str, url: str) -> str:
    """``text`` (e.g. a driver's error message) with every secret of ``url`` replaced by ``***``."""
    for secret in sorted(url_secrets(url), key=len, reverse=True):
        text = text.replace(secret, _MASK)
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
