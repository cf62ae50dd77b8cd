"""``mutexcron urls``: the store URL schemes, listed once for every command's ``--lock-url``."""

from __future__ import annotations

import click

from ..backends import FAMILIES
from ..locks import DEFAULT_LOCK_URL

#: One example per scheme, for people (the scheme is the part before ``://``).
EXAMPLES: dict[str, str] = {
    "memory": "memory:// or memory://NAME (one process: tests)",
    "sqlite": "sqlite:///relative.db, sqlite:////abs/path.db (one host)",
    "mysql": "mysql://user:pass@host:3306/db",
    "mysql+pymysql": "mysql+pymysql://user:pass@host:3306/db",
    "mariadb": "mariadb://user:pass@host:3306/db",
    "mariadb+pymysql": "mariadb+pymysql://user:pass@host:3306/db",
    "postgresql": "postgresql://user:pass@host:5432/db",
    "postgresql+psycopg": "postgresql+psycopg://user:pass@host:5432/db",
    "postgres": "postgres://user:pass@host:5432/db",
    "redis": "redis://[user:pass@]host:6379/0",
    "rediss": "rediss://host:6380/0?ssl_ca_certs=/etc/ssl/ca.pem (TLS)",
    "unix": "unix:///run/redis/redis.sock?db=0",
    "redis+sentinel": "redis+sentinel://h1:26379,h2:26379/mymaster[/db]",
    "redis+cluster": "redis+cluster://h1:7000,h2:7001/?namespace=NAME",
    "rediss+cluster": "rediss+cluster://h1:7000/?namespace=NAME (TLS)",
    "mongodb": "mongodb://[user:pass@]h1:27017,h2/db?replicaSet=rs0",
    "mongodb+srv": "mongodb+srv://user:pass@cluster0.example.net/db",
}


@click.command("urls", context_settings={"help_option_names": ["-h", "--help"]})
def urls() -> None:
    """The store URLs --lock-url takes (every command), with the extra that installs each driver."""
    click.echo(f"--lock-url URL (env MUTEXCRON_LOCK_URL; default {DEFAULT_LOCK_URL}): one URL serves locks and tasks.")
    click.echo("Passwords are shown as *** in every output. Options (?table=, ?namespace=, timeouts): docs/stores.md.\n")
    rows = [("STORE", "EXAMPLE", "INSTALL")]
    for family in FAMILIES:
        install = f'pip install "mutexcron[{family.extra}]"' if family.extra else "-"
        rows += [(family.name, EXAMPLES.get(scheme, f"{scheme}://..."), install) for scheme in family.schemes]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for name, example, install in rows:
        click.echo(f"{name.ljust(widths[0])}  {example.ljust(widths[1])}  {install}".rstrip())
