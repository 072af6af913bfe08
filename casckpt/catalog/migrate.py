"""Schema versioning through Alembic, run programmatically.

The migration scripts live in the repository's top-level ``migrations/`` and
are shipped inside the wheel as ``casckpt/_migrations``. ``casckpt.open``
upgrades an older catalog automatically (migrations are additive and run in
one transaction per revision); a catalog from a newer casckpt is refused.

Opening a current catalog costs one cheap read (:func:`stored_revision` against
:func:`shipped_head`, the newest script by its file name) and imports no Alembic:
Alembic (and its loading of every script) runs only when the two differ.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, inspect, text

from casckpt.catalog import audit
from casckpt.catalog.database import Database
from casckpt.errors import CatalogError, SchemaTooNewError

if TYPE_CHECKING:
    from alembic.config import Config

SCRIPT_NAME = re.compile(r"(\d{4})_\w+\.py")
"""How a migration script is named: ``NNNN_what.py``, its Alembic revision ``"NNNN"``, each
revising the one before (tests/catalog/test_migrations.py holds every script to this)."""


def migrations_dir() -> Path:
    """Where the Alembic scripts are: inside the installed package, or the source checkout."""
    packaged = resources.files("casckpt").joinpath("_migrations")
    if packaged.is_dir():
        return Path(str(packaged))
    checkout = Path(__file__).resolve().parents[2] / "migrations"
    if (checkout / "env.py").is_file():
        return checkout
    raise CatalogError("casckpt's catalog migrations are missing from this installation; reinstall it")


def shipped_head() -> str:
    """The newest schema revision this casckpt ships, read from the scripts' file names (a
    directory listing; :func:`head_revision` asks Alembic, which loads every script)."""
    found = [m.group(1) for p in (migrations_dir() / "versions").iterdir()
             if (m := SCRIPT_NAME.fullmatch(p.name))]
    if not found:
        raise CatalogError("casckpt ships no catalog migrations; reinstall it")
    return max(found)


def stored_revision(connection: Connection) -> str | None:
    """The catalog's schema revision as recorded in Alembic's table, without Alembic (None:
    no such table, an empty or foreign database)."""
    if not inspect(connection).has_table("alembic_version"):
        return None
    rows = connection.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    return str(rows[0]) if len(rows) == 1 else None


# Alembic keeps its migration context and loaded scripts in module globals, so
# every use of it in this process goes through one (re-entrant) lock.
_ALEMBIC_LOCK = threading.RLock()


@contextmanager
def _alembic() -> Iterator[None]:
    """Hold ``_ALEMBIC_LOCK`` (import Alembic's modules inside it) with Alembic's logger at
    WARNING, unless the application set that logger's level itself.

    Alembic logs each plugin, context and revision at INFO: creating a store would print
    some 25 lines into a training job's INFO log that say nothing the job can act on.
    """
    logger = logging.getLogger("alembic")
    with _ALEMBIC_LOCK:
        if logger.level != logging.NOTSET:  # configured by the application: its choice stands
            yield
            return
        logger.setLevel(logging.WARNING)
        try:
            yield
        finally:
            logger.setLevel(logging.NOTSET)


def _config(connection: Connection | None = None) -> Config:
    from alembic.config import Config  # under _alembic(), as every caller is

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """The newest schema revision this casckpt knows."""
    with _alembic():
        from alembic.script import ScriptDirectory

        head = ScriptDirectory.from_config(_config()).get_current_head()
    if head is None:
        raise CatalogError("casckpt ships no catalog migrations; reinstall it")
    return head


def current_revision(connection: Connection) -> str | None:
    """The catalog's schema revision, or None for an empty database."""
    with _alembic():
        from alembic.runtime.migration import MigrationContext

        return MigrationContext.configure(connection).get_current_revision()


def check_not_newer(connection: Connection, where: str) -> str | None:
    """Raise SchemaTooNewError if the catalog's revision is unknown to this casckpt."""
    if inspect(connection).has_table("alembic_version"):
        rows = connection.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
        if len(rows) > 1:  # Alembic raises its own (untyped) CommandError for this
            raise CatalogError(
                f"the catalog at {where} records {len(rows)} schema revisions "
                f"({', '.join(sorted(map(str, rows)))}) where it must record one: its "
                "alembic_version table was tampered with or merged. Restore the catalog from a "
                "backup, or rebuild it (`casckpt catalog rebuild`); nothing was changed."
            )
    revision = current_revision(connection)
    if revision is None:
        if inspect(connection).has_table("versions"):  # Alembic would create the tables again
            raise CatalogError(
                f"the catalog at {where} holds casckpt's tables but records no schema revision "
                "(its alembic_version row or table is gone), so which migrations it has is "
                "unknown. Restore the catalog from a backup, or rebuild it (`casckpt catalog "
                "rebuild`); nothing was changed."
            )
        return None
    with _alembic():
        from alembic.script import ScriptDirectory

        scripts = ScriptDirectory.from_config(_config())
        known = {script.revision for script in scripts.walk_revisions()}
    if revision not in known:
        raise SchemaTooNewError(
            f"the catalog at {where} has schema revision {revision!r}, newer than this casckpt "
            f"knows (newest {head_revision()!r}). Upgrade casckpt (pip install -U casckpt) on "
            "this host; nothing was changed."
        )
    return revision


def upgrade(connection: Connection) -> str | None:
    """Bring the catalog to the head revision (a no-op when it is already there); returns the
    revision an existing catalog was upgraded from (None: none was, or it was created).

    Upgrading an existing catalog adds a ``catalog.migrate`` row to its audit trail in
    the same transaction (creating a new one adds none).

    Thread-safe: upgrades within one process run one at a time. The
    connection's transaction (on SQLite ``BEGIN IMMEDIATE``: the database's
    write lock) is begun before ``_ALEMBIC_LOCK`` is taken, the order
    :func:`check_not_newer`'s callers take them in; the other order deadlocks
    two threads creating one catalog until SQLite's busy timeout.
    """
    if not connection.in_transaction():
        connection.begin()
    before, head = current_revision(connection), head_revision()
    if before == head:
        return None
    with _alembic():
        from alembic import command

        command.upgrade(_config(connection), "head")
    if before is not None:  # an existing store's schema changed (a new one was created)
        audit.add(connection, "catalog.migrate", None, {"from": before, "to": head})
    return before


_MIGRATION_LOCK = 0x6361736B  # "cask": PostgreSQL advisory lock key for schema upgrades


def upgrade_once(db: Database, where: str) -> str | None:
    """Refuse a newer schema, then upgrade an older one; one process at a time. Returns the
    revision an existing catalog was upgraded from (None: none was).

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
            before = upgrade(conn)
            conn.commit()
        finally:
            if postgres:
                conn.rollback()
                conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _MIGRATION_LOCK})
                conn.commit()
    return before
