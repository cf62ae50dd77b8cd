"""The Django recipe on every SQL store: ``pool.add(..., transaction=connection)`` inside ``atomic()``.

Each case runs a Django process of its own (settings configured in the script) on the store's
database: PostgreSQL through Django's psycopg backend, MariaDB through Django's MySQL backend
(PyMySQL standing in for mysqlclient), SQLite through Django's sqlite3 backend. An add in an atomic
block that fails leaves neither the business row nor the task; one that commits leaves both;
Django's connection outside ``atomic()`` is refused. The example project (examples/django_shop)
is tested in tests/test_examples_tasks.py.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy

from tests.backends import backend_params, drop_tasks_table, require_server

SCRIPT = """
import json, sys
from datetime import timedelta
if {mysql}:
    import pymysql
    pymysql.install_as_MySQLdb()
import django
from django.conf import settings
settings.configure(DATABASES={{"default": {database}}}, USE_TZ=True)
django.setup()
from django.db import connection, transaction
from mutexcron import ConfigurationError, TaskPool

pool = TaskPool({url!r})
pool.store.ping()
with connection.cursor() as cur:
    cur.execute("CREATE TABLE {biz} (id INTEGER PRIMARY KEY)")
seen = {{}}
try:
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("INSERT INTO {biz} (id) VALUES (1)")
        pool.add("close", "1", timedelta(minutes=30), transaction=connection)
        raise RuntimeError("the view failed")
except RuntimeError:
    pass
with transaction.atomic():
    with connection.cursor() as cur:
        cur.execute("INSERT INTO {biz} (id) VALUES (2)")
    seen["added"] = str(pool.add("close", "2", timedelta(minutes=30), transaction=connection))
    seen["cancel_unknown"] = pool.cancel("close", "3", transaction=connection)
try:
    pool.add("close", "4", timedelta(minutes=30), transaction=connection)
except ConfigurationError as exc:
    seen["outside"] = str(exc)
with connection.cursor() as cur:
    cur.execute("SELECT id FROM {biz} ORDER BY id")
    seen["rows"] = [row[0] for row in cur.fetchall()]
    cur.execute("DROP TABLE {biz}")
seen["tasks"] = sorted(t.key for t in pool.list(code="close"))
pool.close()
print("RESULT " + json.dumps(seen))
"""


def django_database(kind: str, tmp_path: Path) -> tuple[dict[str, object], str]:
    """Django's DATABASES entry and the task store's URL, on one database."""
    if kind == "sqlite":
        path = tmp_path / "django.sqlite3"
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": str(path)}, f"sqlite:///{path}"
    base = require_server(kind)
    url = sqlalchemy.make_url(base)
    engine = "postgresql" if kind == "postgresql" else "mysql"
    entry = {"ENGINE": f"django.db.backends.{engine}", "NAME": url.database, "USER": url.username or "", "HOST": url.host,
             "PORT": str(url.port or ""), "PASSWORD": url.password or ""}  # fmt: skip
    return entry, base


@pytest.mark.parametrize("kind", backend_params("sqlite", "mysql", "postgresql"))
def test_django_add_in_atomic_commits_with_the_block_or_not_at_all(kind: str, tmp_path: Path) -> None:
    pytest.importorskip("django")
    database, base = django_database(kind, tmp_path)
    url = f"{base}{'&' if '?' in base else '?'}tasks_table=mc_dj_{secrets.token_hex(3)}"
    script = SCRIPT.format(mysql=kind == "mysql", database=repr(database), url=url, biz=f"mc_djbiz_{secrets.token_hex(3)}")
    try:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    finally:
        drop_tasks_table(url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert seen["rows"] == [2] and seen["tasks"] == ["2"]  # the rolled-back block left neither row 1 nor task 1
    assert seen["added"] == "inserted" and seen["cancel_unknown"] is False
    assert "autocommit mode here" in seen["outside"]
