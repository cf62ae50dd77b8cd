"""The mutexcron task table, so the schema is managed by Django's migrations like the rest.

The statements are the task-table part of ``mutexcron ddl`` for SQLite (the default table name,
``mutexcron_tasks``; ``?tasks_table=`` in the URL names another):

    mutexcron ddl --lock-url sqlite:///db.sqlite3

With PostgreSQL or MySQL/MariaDB as the database, paste that database's output instead
(``mutexcron ddl --lock-url postgresql://...``): the column types differ. The store also creates
the table itself if it is missing (CREATE ... IF NOT EXISTS), so the order does not matter, and
adds the columns a newer mutexcron needs to a table created from an older copy of this file.
"""

from django.db import migrations

MUTEXCRON_TASKS_DDL = [
    """CREATE TABLE IF NOT EXISTS mutexcron_tasks (
    code             TEXT    NOT NULL,
    task_key         TEXT    NOT NULL,
    due              TEXT    NOT NULL,
    run_at           TEXT,
    payload          TEXT    NOT NULL,
    state            TEXT    NOT NULL DEFAULT 'queued',
    attempt          INTEGER NOT NULL DEFAULT 0,
    token            INTEGER NOT NULL DEFAULT 0,
    owner            TEXT,
    lease_until      TEXT,
    last_error       TEXT,
    pending_due      TEXT,
    pending_payload  TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    created          TEXT    NOT NULL,
    updated          TEXT    NOT NULL,
    occurrence       INTEGER,
    started          INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (code, task_key)
)""",
    "CREATE INDEX IF NOT EXISTS mutexcron_tasks_run_at ON mutexcron_tasks (code, run_at)",
    "CREATE INDEX IF NOT EXISTS mutexcron_tasks_done ON mutexcron_tasks (updated) WHERE state = 'done'",
]


class Migration(migrations.Migration):
    dependencies = [("orders", "0001_initial")]

    operations = [
        migrations.RunSQL(
            sql=MUTEXCRON_TASKS_DDL,
            reverse_sql=[
                "DROP INDEX IF EXISTS mutexcron_tasks_done",
                "DROP INDEX IF EXISTS mutexcron_tasks_run_at",
                "DROP TABLE IF EXISTS mutexcron_tasks",
            ],
        ),
    ]
