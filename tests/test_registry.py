"""The one registry of store families (``mutexcron.backends.FAMILIES``) and the classes agree.

Every scheme routes to a lock store and a backend that accept it, every other backend refuses it,
every row's modules import (and only when asked), and ``import mutexcron`` loads no driver.
No server is contacted: stores are built, never used.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import metadata
from pathlib import Path
from typing import Any

import pytest

from mutexcron.backends import FAMILIES, StoreFamily, backend_from_url, family, family_of, load
from mutexcron.backends.base import Backend
from mutexcron.errors import ConfigurationError
from mutexcron.locks import SCHEMES, LockStore, lock_store_from_url

pytestmark = pytest.mark.memory

#: A URL of each scheme that builds a store without contacting anything ({tmp}: a temporary directory).
SAMPLE_URLS = {
    "memory": "memory://registry-test",
    "sqlite": "sqlite:///{tmp}/registry.db",
    "mysql": "mysql://root@127.0.0.1:1/test",
    "mysql+pymysql": "mysql+pymysql://root@127.0.0.1:1/test",
    "mariadb": "mariadb://root@127.0.0.1:1/test",
    "mariadb+pymysql": "mariadb+pymysql://root@127.0.0.1:1/test",
    "postgresql": "postgresql://postgres@127.0.0.1:1/test",
    "postgresql+psycopg": "postgresql+psycopg://postgres@127.0.0.1:1/test",
    "postgres": "postgres://postgres@127.0.0.1:1/test",
    "redis": "redis://127.0.0.1:1/0",
    "rediss": "rediss://127.0.0.1:1/0",
    "unix": "unix:///tmp/registry-test.sock",
    "redis+sentinel": "redis+sentinel://127.0.0.1:1/mymaster",
    "redis+cluster": "redis+cluster://127.0.0.1:1",
    "rediss+cluster": "rediss+cluster://127.0.0.1:1",
    "mongodb": "mongodb://127.0.0.1:1/registry",
    "mongodb+srv": "mongodb+srv://cluster.example.invalid/registry",
}
DRIVERS = ("redis", "pymongo", "psycopg", "pymysql")


def _rows_and_schemes() -> Iterator[Any]:
    for row in FAMILIES:
        for scheme in row.schemes:
            yield pytest.param(row, scheme, id=scheme)


def _options(scheme: str) -> dict[str, Any]:
    """mongodb+srv resolves its hosts in DNS when its client is built: give it a client instead."""
    if scheme != "mongodb+srv":
        return {}
    mongomock = pytest.importorskip("mongomock")
    return {"client": mongomock.MongoClient(tz_aware=True)}


def test_schemes_is_derived_from_the_registry_and_no_scheme_is_in_two_rows() -> None:
    pairs = [(scheme, row) for row in FAMILIES for scheme in row.schemes]
    assert len({scheme for scheme, _ in pairs}) == len(pairs), "a scheme in two rows"
    assert SCHEMES == {scheme: (row.lock_store, row.extra) for scheme, row in pairs}
    assert set(SAMPLE_URLS) == set(SCHEMES), "a scheme without a sample URL here"
    assert [row.name for row in FAMILIES] == ["memory", "sqlite", "mysql", "postgresql", "redis", "mongodb"]
    for scheme, row in pairs:
        assert scheme == scheme.lower() and family_of(f"{scheme}://x") is row and family(row.name) is row


@pytest.mark.parametrize(("row", "scheme"), list(_rows_and_schemes()))
def test_every_scheme_builds_the_rows_lock_store_on_the_rows_backend(row: StoreFamily, scheme: str, tmp_path: Path) -> None:
    url = SAMPLE_URLS[scheme].format(tmp=tmp_path)
    for driver in row.drivers:
        pytest.importorskip(driver)
    store = lock_store_from_url(url, **_options(scheme))
    backend = backend_from_url(url, **_options(scheme))
    try:
        assert type(store) is load(row, row.lock_store)
        assert type(store.backend) is type(backend) is load(row, row.backend)  # type: ignore[attr-defined]
        assert store.url == backend.url == url
    finally:
        store.close()
        backend.close()


@pytest.mark.parametrize("backend_row", [r for r in FAMILIES if r.name != "memory"], ids=lambda r: r.name)
def test_a_backend_refuses_the_schemes_of_other_families(backend_row: StoreFamily, tmp_path: Path) -> None:
    """Each backend checks its scheme against the registry (memory:// takes any name, so it is left out)."""
    cls: type[Backend] = load(backend_row, backend_row.backend)
    for row in FAMILIES:
        if row.backend == backend_row.backend:
            continue
        for scheme in row.schemes:
            with pytest.raises(ConfigurationError):
                cls(SAMPLE_URLS[scheme].format(tmp=tmp_path))


@pytest.mark.parametrize("row", FAMILIES, ids=lambda r: r.name)
def test_every_row_names_importable_classes_and_a_real_extra_and_marker(row: StoreFamily, pytestconfig: pytest.Config) -> None:
    for driver in row.drivers:
        pytest.importorskip(driver)
    assert issubclass(load(row, row.backend), Backend)
    assert issubclass(load(row, row.lock_store), LockStore)
    assert row.task_store is None or isinstance(load(row, row.task_store), type)
    for target in (row.backend, row.lock_store):
        assert "schemes" not in vars(load(row, target)), f"{target} keeps its own scheme list"
    if row.extra is not None:
        assert row.extra in (metadata("mutexcron").get_all("Provides-Extra") or []), f"no extra mutexcron[{row.extra}]"
        assert row.drivers, "a row with an extra names the driver modules it installs"
    markers = [m.partition(":")[0] for m in pytestconfig.getini("markers")]
    assert row.name in markers, f"no pytest marker {row.name!r}"


def test_a_missing_driver_names_the_rows_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for row in FAMILIES:
        for driver in row.drivers:
            monkeypatch.setitem(sys.modules, driver, None)  # makes `import driver` fail, even if loaded
            with pytest.raises(ConfigurationError, match=rf'pip install "mutexcron\[{row.extra}\]"'):
                lock_store_from_url(SAMPLE_URLS[row.schemes[0]])
            monkeypatch.undo()


def test_importing_mutexcron_loads_no_driver_and_no_store_module() -> None:
    code = (
        "import json, sys; import mutexcron, mutexcron.locks, mutexcron.backends; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    drivers = [m for m in loaded if m.split(".")[0] in DRIVERS]
    assert not drivers, f"import mutexcron loaded drivers: {drivers}"
    # The contract (base), the lock record and the store's reachability are no store modules.
    shared = (".base", ".record", ".health")
    stores = [m for m in loaded if m.startswith(("mutexcron.backends.", "mutexcron.locks.")) and not m.endswith(shared)]
    assert not stores, f"import mutexcron loaded store modules: {stores}"
