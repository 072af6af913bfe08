"""Schema versioning through Alembic, run programmatically.

The migration scripts live in the repository's top-level ``migrations/`` and
are shipped inside the wheel as ``casckpt/_migrations``. ``casckpt.open``
upgrades an older catalog automatically (migrations are additive and run in
one transaction per revision); a catalog from a newer casckpt is refused.
"""

from __future__ import annotations

import threading
from importlib import resources
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, text

from casckpt.catalog.database import Database
from casckpt.errors import CatalogError, SchemaTooNewError


def migrations_dir() -> Path:
    """Where the Alembic scripts are: inside the installed package, or the source checkout."""
    packaged = resources.files("casckpt").joinpath("_migrations")
    if packaged.is_dir():
        return Path(str(packaged))
    checkout = Path(__file__).resolve().parents[2] / "migrations"
    if (checkout / "env.py").is_file():
        return checkout
    raise CatalogError("casckpt's catalog migrations are missing from this installation; reinstall it")


# Alembic keeps its migration context and loaded scripts in module globals, so
# every use of it in this process goes through one (re-entrant) lock.
_ALEMBIC_LOCK = threading.RLock()


def _config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """The newest schema revision this casckpt knows."""
    with _ALEMBIC_LOCK:
        head = ScriptDirectory.from_config(_config()).get_current_head()
    if head is None:
        raise CatalogError("casckpt ships no catalog migrations; reinstall it")
    return head


def current_revision(connection: Connection) -> str | None:
    """The catalog's schema revision, or None for an empty database."""
    with _ALEMBIC_LOCK:
        return MigrationContext.configure(connection).get_current_revision()


def check_not_newer(connection: Connection, where: str) -> str | None:
    """Raise SchemaTooNewError if the catalog's revision is unknown to this casckpt."""
    revision = current_revision(connection)
    if revision is None:
        return None
    with _ALEMBIC_LOCK:
        scripts = ScriptDirectory.from_config(_config())
        known = {script.revision for script in scripts.walk_revisions()}
    if revision not in known:
        raise SchemaTooNewError(
            f"the catalog at {where} has schema revision {revision!r}, newer than this casckpt "
            f"knows (newest {head_revision()!r}). Upgrade casckpt (pip install -U casckpt) on "
            "this host; nothing was changed."
        )
    return revision


def upgrade(connection: Connection) -> None:
    """Bring the catalog to the head revision (a no-op when it is already there).

    Thread-safe: upgrades within one process run one at a time. The
    connection's transaction (on SQLite ``BEGIN IMMEDIATE``: the database's
    write lock) is begun before ``_ALEMBIC_LOCK`` is taken, the order
    :func:`check_not_newer`'s callers take them in; the other order deadlocks
    two threads creating one catalog until SQLite's busy timeout.
    """
    if not connection.in_transaction():
        connection.begin()
    if current_revision(connection) == head_revision():
        return
    with _ALEMBIC_LOCK:
        command.upgrade(_config(connection), "head")


_MIGRATION_LOCK = 0x6361736B  # "cask": PostgreSQL advisory lock key for schema upgrades


def upgrade_once(db: Database, where: str) -> None:
    """Refuse a newer schema, then upgrade an older one; one process at a time.

    On PostgreSQL a session advisory lock serialises hosts opening the
    catalog at once; on SQLite ``BEGIN IMMEDIATE`` does.

    Raises:
        SchemaTooNewError: the catalog at ``where`` was written by a newer casckpt.
    """
    with db.connect(write=True) as conn:
        postgres = conn.dialect.name == "postgresql"
        if postgres:
            conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _MIGRATION_LOCK})
            conn.commit()
        try:
            with conn.begin():
                check_not_newer(conn, where)
            upgrade(conn)
            conn.commit()
        finally:
            if postgres:
                conn.rollback()
                conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _MIGRATION_LOCK})
                conn.commit()
