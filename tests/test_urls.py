"""URL masking and parsing helpers, and the scheme registry's errors."""

from __future__ import annotations

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
