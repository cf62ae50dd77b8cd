"""URL masking and parsing helpers, and the scheme registry's errors."""

from __future__ import annotations

import random
import string
from urllib.parse import quote, unquote

import pytest

from mutexcron.errors import ConfigurationError
from mutexcron.locks import lock_store_from_url
from mutexcron.urls import mask_url, pop_query, redact

pytestmark = pytest.mark.memory


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql://app:s3cr%40t@db:5432/ops", "postgresql://app:***@db:5432/ops"),
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        ("redis+sentinel://u:pw@h1:26379,h2:26379/mymaster", "redis+sentinel://u:***@h1:26379,h2:26379/mymaster"),
        ("mongodb://u:pw@h1,h2/db?replicaSet=rs0&password=x", "mongodb://u:***@h1,h2/db?replicaSet=rs0&password=***"),
        ("sqlite:////var/lib/x.db", "sqlite:////var/lib/x.db"),
        ("mysql://root@127.0.0.1/test", "mysql://root@127.0.0.1/test"),
        # Passwords with unescaped '/', '@', ':', '?', %-escapes and unicode (issue 8, C11).
        ("postgresql://app:s3cr/et@db1/ops", "postgresql://app:***@db1/ops"),
        ("redis://:p@ssw0rd@host", "redis://:***@host"),
        ("redis://u:a:b:c@host:6379/0", "redis://u:***@host:6379/0"),
        ("redis://:pa?ss@h:1/0", "redis://:***@h:1/0"),
        ("mysql://u:p%2Fw%40rd@h/db", "mysql://u:***@h/db"),
        ("mysql://u:pässwörd✓@h/db", "mysql://u:***@h/db"),
        ("sqlite:////tmp/a@b.db", "sqlite:////tmp/a@b.db"),
        # A user-info part that cannot be split with confidence is hidden whole.
        ("redis://we/ird:pw@h/0", "redis://***@h/0"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_redact_removes_the_password_from_driver_messages() -> None:
    url = "postgresql://app:hunter2@db/ops"
    assert redact('FATAL: password "hunter2" rejected', url) == 'FATAL: password "***" rejected'


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app:s3cr/et@db1/ops",
        "redis://:p@ssw0rd@host",
        "mysql://u:p%2Fw%40rd@h/db",
        "mysql://u:pässwörd✓@h/db",
        "mongodb://u:pw@h/db?password=hunter22",
    ],
)
def test_no_secret_survives_masking_or_redaction(url: str) -> None:
    from mutexcron.urls import url_secrets

    secrets = url_secrets(url)
    assert secrets
    message = f"connect to {url} failed: password {sorted(secrets)} rejected"
    for secret in secrets:
        assert secret not in mask_url(url)
        assert secret not in redact(message, url)


def test_unreachable_store_error_and_log_line_hide_a_password_with_a_slash(caplog: pytest.LogCaptureFixture) -> None:
    from mutexcron import MutexScheduler
    from mutexcron.errors import StoreUnavailableError

    url = "postgresql://app:s3cr/et@127.0.0.1:1/ops"  # nothing listens on port 1
    store = lock_store_from_url(url)
    try:
        with pytest.raises(StoreUnavailableError) as info:
            store.ping()
        assert "s3cr/et" not in str(info.value) and "s3cr" not in str(info.value)
        assert "app:***@127.0.0.1:1/ops" in str(info.value)
        sched = MutexScheduler(lock_url=url)
        assert "s3cr" not in repr(sched.lock_store)
    finally:
        store.close()


def test_pop_query_keeps_absolute_sqlite_paths() -> None:
    assert pop_query("sqlite:////abs/x.db?table=t", "table") == ("sqlite:////abs/x.db", {"table": "t"})
    assert pop_query("mysql://h/db?charset=utf8&table=t", "table") == ("mysql://h/db?charset=utf8", {"table": "t"})


def test_unknown_scheme_lists_the_supported_ones() -> None:
    with pytest.raises(ConfigurationError) as info:
        lock_store_from_url("ftp://u:hunter2@h/x")
    message = str(info.value)
    assert "hunter2" not in message and "postgresql://" in message and "redis+sentinel://" in message


def test_bad_table_name_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="table"):
        lock_store_from_url("sqlite:///x.db?table=locks;drop")


def test_missing_driver_is_a_configuration_error_with_the_pip_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "redis", None)  # makes `import redis` fail
    monkeypatch.delitem(sys.modules, "mutexcron.locks.redis", raising=False)
    with pytest.raises(ConfigurationError, match=r'pip install "mutexcron\[redis\]"'):
        lock_store_from_url("redis://127.0.0.1:6379/0")


# -- the rule, not a list (issue 22, item 10) ---------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("mysql://u@h/db?ssl_key_password=kp4ss&ssl_key=/k.pem", "mysql://u@h/db?ssl_key_password=***&ssl_key=***"),
        (
            "mongodb://h/db?authMechanism=MONGODB-AWS&authMechanismProperties=AWS_SESSION_TOKEN:FQoGZXIv&authSource=$external",
            "mongodb://h/db?authMechanism=MONGODB-AWS&authMechanismProperties=***&authSource=%24external",
        ),
        ("redis://h/0?X-Amz-Signature=abc123&namespace=ops", "redis://h/0?X-Amz-Signature=***&namespace=ops"),
        ("postgresql://h/db?sslpassword=x1&table=t&history=5", "postgresql://h/db?sslpassword=***&table=t&history=5"),
    ],
)
def test_secret_query_values_are_masked_by_the_name_rule(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_redact_masks_every_url_inside_a_text() -> None:
    text = "cannot connect to postgresql://app:hunter22@db/ops (via 'mongodb://u:pw99@h/db?token=t0k3n')"
    assert redact(text) == "cannot connect to postgresql://app:***@db/ops (via 'mongodb://u:***@h/db?token=***')"


def test_redact_leaves_a_url_with_nothing_to_hide_as_it_is() -> None:
    """A dashboard page shows the masked store URL right before markup: re-encoding it swallowed
    the markup (`&amp;b=2</span><form id="token">` became `&amp%3Bb=2%3C/span%3E%3Cform`)."""
    page = '<span>postgresql://app:***@db/ops?table=t&amp;tasks_table=q</span><form id="token"><button>'
    assert redact(page, "postgresql://app:hunter22@db/ops?table=t&tasks_table=q") == page
    plain = "see sqlite:////var/lib/app.db?table=locks&history=5</td><td>x"
    assert redact(plain) == plain
    leaked = '<span>postgresql://app:hunter22@db/ops?table=t</span><form id="token">'
    assert "hunter22" not in redact(leaked) and "app:***@db" in redact(leaked)


_SECRET_NAMES = ("password", "ssl_key_password", "sslPassword", "authMechanismProperties", "access_token", "apiKey",
                 "X-Amz-Credential", "client_secret", "sig", "session", "tlsCertificateKeyFilePassword", "PWD")  # fmt: skip
_PLAIN_NAMES = ("table", "history", "namespace", "replicaSet", "authSource", "connect_timeout", "sslmode", "pool_size")


def _generated_url(rng: random.Random) -> tuple[str, list[str], list[str]]:
    """A URL with generated secrets in its user-info and query, (the URL, its secrets, its plain values).

    Secrets start with ``Q9`` and plain parts use lower-case letters and digits only, so a secret
    can only show up in the output where it was left unmasked."""
    special = "/@:?#%&=+,;$!'*~. "
    alphabet = string.ascii_letters + string.digits + special

    def secret() -> str:
        return "Q9" + "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 16)))

    def plain() -> str:
        return "".join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(rng.randint(1, 10)))

    scheme = rng.choice(("mysql", "mysql+pymysql", "postgresql", "redis", "rediss", "redis+sentinel", "mongodb",
                         "mongodb+srv", "https"))  # fmt: skip
    secrets, plains, userinfo = [], [], ""
    kind = rng.choice(("none", "user", "user+password", "password"))
    if kind != "none":
        user = plain() if kind != "password" else ""
        password = secret().replace(" ", "") if kind != "user" else None
        if password is not None and rng.random() < 0.5:
            password = quote(password, safe="")  # escaped as the drivers document; raw otherwise
        if password is not None:
            secrets.append(password)
        userinfo = (user if password is None else f"{user}:{password}") + "@"
    hosts = ",".join(f"{plain()}:{rng.randint(1, 65535)}" for _ in range(rng.randint(1, 3)))
    query = []
    for _ in range(rng.randint(0, 4)):
        if rng.random() < 0.5:
            value = secret()
            secrets.append(value)
            query.append(f"{rng.choice(_SECRET_NAMES)}={quote(value, safe='')}")
        else:
            value = plain()
            plains.append(value)
            query.append(f"{rng.choice(_PLAIN_NAMES)}={value}")
    url = f"{scheme}://{userinfo}{hosts}/{plain()}" + (f"?{'&'.join(query)}" if query else "")
    return url, secrets, plains


def _forms(secret: str) -> set[str]:
    return {s for s in (secret, unquote(secret), quote(unquote(secret), safe="")) if len(s) >= 3}


def test_no_generated_secret_survives_masking_or_redaction() -> None:
    """Property-style: 3000 generated URLs (seeded, so a failure can be replayed): no form of a
    secret is left in the masked URL, in a message quoting the URL, nor in a message quoting the
    secret itself when the URL is known; plain query values stay readable."""
    rng = random.Random(22)
    for _ in range(3000):
        url, secrets, plains = _generated_url(rng)
        masked = mask_url(url)
        quoted = redact(f"error: could not reach {url}, giving up", None)
        told = redact(f"error: {' and '.join(secrets)} refused by {url}", url)
        for secret in secrets:
            for form in _forms(secret):
                assert form not in masked, (url, masked)
                assert form not in quoted, (url, quoted)
                assert form not in told, (url, told)
        query = masked.partition("?")[2]
        for value in plains:
            assert f"={value}" in query, (url, masked)


def test_a_jobs_args_and_kwargs_are_masked_by_the_same_rule() -> None:
    from mutexcron.urls import mask_values

    kwargs = {"job": "sync", "api_token": "t-123", "dsn": "postgresql://app:pw-9@db/x", "nested": {"password": "p"}}
    assert mask_values(kwargs) == {"job": "sync", "api_token": "***", "dsn": "postgresql://app:***@db/x",
                                   "nested": {"password": "***"}}  # fmt: skip
    assert mask_values(("redis://:s3@h/0", 5)) == ("redis://:***@h/0", 5)
