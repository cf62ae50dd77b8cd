"""URL helpers shared by the CLI and the stores, including the one secret-masking rule.

Every log line, error message, endpoint and ``status`` line that shows a URL goes through
:func:`mask_url` (or :func:`mask_path` for a monitor's ping URL, whose path is the secret), and
every driver or library message that may quote a URL or a password goes through :func:`redact`.

The rule, not a list of known names:

* the password of any user-info (``scheme://user:password@hosts/...``) is hidden. The user-info
  is everything up to the **last** ``@`` of the authority, as the drivers take it, so a password
  with an unescaped ``/``, ``@``, ``:`` or ``?`` is still hidden whole; when it cannot be split
  with confidence, the whole user-info part is hidden;
* the value of every query parameter whose name suggests a secret (:func:`is_secret_name`: it
  holds ``pass``, ``pwd``, ``secret``, ``token``, ``key``, ``cred``, ``auth``, ``sig``,
  ``session`` or ``private``, in any case and spelling) is hidden;
* :func:`redact` also masks, by the same rule, every URL it finds inside the text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode

#: Fragments of a query parameter's name that make its value a secret (compared lower-cased,
#: without ``_``, ``-`` and ``.``): ``ssl_key_password``, ``authMechanismProperties``,
#: ``X-Amz-Signature``, ``access_token``, ``tlsCertificateKeyFilePassword``...
_SECRET_FRAGMENTS = ("pass", "pwd", "secret", "token", "key", "cred", "auth", "sig", "session", "private")
#: Names that hold such a fragment but name no secret (MongoDB's), shown as they are.
_NOT_SECRET = frozenset({"authsource", "authmechanism"})
_MASK = "***"
#: A URL inside free text (an error message): a scheme, ``://``, then up to a space (a quote or a
#: bracket may be part of a raw password); closing punctuation at its end is the text's.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,30}://\S+")
_TRAILING = "'\")]}>,.;"


def is_secret_name(name: str) -> bool:
    """True if a query parameter called ``name`` may hold a secret (its value is then masked)."""
    folded = re.sub(r"[\W_]", "", name.lower())
    return folded not in _NOT_SECRET and any(fragment in folded for fragment in _SECRET_FRAGMENTS)


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


def split_userinfo(url: str) -> tuple[str, str | None, str | None]:
    """``url`` without its user-info, and the user and password (unquoted; None if absent), split
    as :func:`mask_url` splits them (up to the last ``@``: a password may hold ``/`` or ``@``)."""
    head, userinfo, rest = _split(url)
    if userinfo is None:
        return url, None, None
    user, colon, password = userinfo.partition(":")
    return head + rest, unquote(user), (unquote(password) if colon else None)


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
        pairs = [(k, _MASK if is_secret_name(k) else v) for k, v in parse_qsl(query, keep_blank_values=True)]
        url = f"{base}?{urlencode(pairs, safe='*/:,')}"
    return url


def mask_path(url: str) -> str:
    """A URL whose path is itself the secret (a monitor's ping URL, ``https://hc-ping.com/<uuid>``,
    ``https://cronitor.link/p/<api-key>/<job>``), safe to log: the scheme and host are kept (any
    user-info hidden whole: a monitor's user name may be its token); the path and query become ``/***``."""
    head, userinfo, rest = _split(url)
    if not head:  # not scheme://host...: nothing can be told apart from a secret
        return _MASK
    end = min([i for i in (rest.find(c) for c in "/?#") if i >= 0], default=len(rest))
    authority = f"{head}{'' if userinfo is None else _MASK + '@'}{rest[:end]}"
    return authority + (f"/{_MASK}" if rest[end:].strip("/") else "")


def url_secrets(url: str, *, path: bool = False) -> set[str]:
    """The secret strings of ``url`` (password, secret query values), raw and decoded.

    With ``path`` (a monitor's ping URL), the whole user-info, the path, each of its segments
    and every query value are secrets too.
    """
    found: set[str] = set()
    head, userinfo, rest = _split(url)
    if userinfo is not None:
        _user, password = _user_and_password(userinfo)
        found.update(s for s in (password, userinfo if path else None) if s)
    if "?" in rest:  # after the user-info: a raw password may hold a "?"
        for key, value in parse_qsl(rest.partition("?")[2], keep_blank_values=True):
            if (path or is_secret_name(key)) and value:
                found.add(value)
    if path and head:  # path segments shorter than 6 (``fail``, ``p``) are words, not secrets
        tail = rest[rest.find("/") :].partition("?")[0].partition("#")[0] if "/" in rest else ""
        found.update(s for s in (url, tail, *tail.split("/")) if len(s) >= 6)
    variants = set()
    for secret in found:
        variants |= {secret, unquote(secret), quote(unquote(secret), safe="")}
    return {s for s in variants if len(s) >= 2}


def redact(text: str, url: str | None = None, *, path: bool = False) -> str:
    """``text`` (e.g. a driver's error message) with every secret of ``url`` (see
    :func:`url_secrets`) replaced by ``***``, and every URL inside it masked by :func:`mask_url`
    (:func:`mask_path` with ``path``)."""
    if url is not None:
        for secret in sorted(url_secrets(url, path=path), key=len, reverse=True):
            text = text.replace(secret, _MASK)
    if "://" not in text:
        return text
    mask = mask_path if path else mask_url

    def masked(found: re.Match[str]) -> str:
        url = found.group(0)
        core = url.rstrip(_TRAILING)
        if not path and not _hides_something(core):
            # Left as it is: re-encoding a URL with nothing to hide (or one masked already) would
            # mangle the text around it, e.g. the markup after a URL in a page (`...&amp;b=2</span>`).
            return url
        return mask(core) + url[len(core) :]

    return _URL_IN_TEXT.sub(masked, text)


def mask_values(value: Any) -> Any:
    r"""``value`` (a job's args or kwargs) with the same rule applied inside: the value of every key
    whose name suggests a secret (:func:`is_secret_name`) is ``***``, and every text is :func:`redact`\ ed."""
    if isinstance(value, Mapping):
        return {k: _MASK if isinstance(k, str) and is_secret_name(k) else mask_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(mask_values(v) for v in value) if isinstance(value, list) else tuple(mask_values(v) for v in value)
    return redact(value) if isinstance(value, str) else value


def _hides_something(url: str) -> bool:
    """True if :func:`mask_url` would hide a secret of ``url`` (one not shown as ``***`` already)."""
    return any(unquote(secret) != _MASK for secret in url_secrets(url))


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
