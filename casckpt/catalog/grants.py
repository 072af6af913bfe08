"""The catalog's three roles: which privileges each needs, as PostgreSQL GRANTs, and whether
the credentials in use hold what deleting needs (gc's preflight).

- *reader*: SELECT on every table (restore, log, show, diff, history, check).
- *writer*: what a commit needs -- SELECT, INSERT on every table but gc's own (``gc_live``,
  ``gc_runs``); UPDATE where a commit, a tag or a soft delete changes a row (:data:`WRITER_UPDATES`);
  DELETE only on ``leases`` (a commit ends its own lease). It deletes no other row.
- *admin*: every privilege on every table and sequence (gc, purge, repair, migrations of
  versions). Schema upgrades (``casckpt migrate``, an ``open`` of an older catalog) ALTER
  tables, which PostgreSQL allows only their owner: run those as the owner.

Everything is generated from :data:`casckpt.catalog.schema.metadata`, so a table a migration
adds is covered: readers read it, writers insert into it, admins do everything.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Integer, Table, make_url, text

from casckpt.catalog import schema as s
from casckpt.catalog.catalog import Catalog
from casckpt.errors import InvalidArgumentError

ROLES = ("reader", "writer", "admin")
"""The roles, least privileged first."""

ALEMBIC_TABLE = "alembic_version"
"""Alembic's revision table: every role reads it when opening the store."""

GC_TABLES = s.GC_TABLES
"""Tables only gc writes (its mark set and its run log)."""

WRITER_UPDATES = {
    "chunks": "a publish re-reads its chunks FOR SHARE (a row lock: needs UPDATE) and revives "
              "chunks gc condemned but has not swept",
    "runs": "a publish locks its run's row (SELECT ... FOR UPDATE); retention policies",
    "versions": "soft delete and undelete (versions.state), e.g. the Lightning plugin's "
                "remove_checkpoint; gc purges the rows later; durability, set by the drain",
    "tags": "moving a tag to another version",
    "store_info": "the counter of refs/ records, read FOR UPDATE and bumped",
    "packs": "verified_at, set when check reads a pack; state and shards' scheme when a drain "
             "makes a fast-tier pack live, or finds it lost",
    "tiers": "a fast tier found wiped at open is marked lost",
    "shards": "verified_at, set when check reads a shard",
    "mirrors": "a mirror run records its start, its end and error, and the destination's identity",
    "mirror_versions": "a mirror run upserts each version's outcome as it is known",
    "mirror_tags": "a mirror run upserts each tag it carried (and forgets them into a replaced destination)",
}
"""Tables a writer UPDATEs, each with why."""

WRITER_UPDATE_COLUMNS = {
    "store_info": 'UPDATE ("value")',
    "mirrors": 'UPDATE ("run_started_at", "run_finished_at", "run_error", "dest_store_id")',
}
"""A writer's UPDATE limited to some columns: renaming a ``store_info`` key would remove a
row by another name (the key record's: keyless processes would then write plaintext); a
mirror's run updates its outcome, never its destination, key file or selection."""

WRITER_DELETES = {"leases": "a commit ends its own lease (gc reaps crashed ones)"}
"""The only rows a writer deletes, with why."""

_ROLE_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def default_role_name(role: str) -> str:
    """``casckpt_<role>``."""
    return f"casckpt_{role}"


def _tables() -> list[Table]:
    return list(s.metadata.sorted_tables)


def _sequences(table: Table) -> list[str]:
    """The sequences of a table's SERIAL columns (PostgreSQL names them table_column_seq)."""
    return [f"{table.name}_{col.name}_seq" for col in table.primary_key.columns
            if isinstance(col.type, Integer) and col.autoincrement is True]


def table_privileges(role: str) -> dict[str, tuple[str, ...]]:
    """Table name -> the privileges ``role`` needs on it (alembic's table included)."""
    check_role(role)
    out: dict[str, tuple[str, ...]] = {}
    for table in _tables():
        if role == "reader" or (role == "writer" and table.name in GC_TABLES):
            out[table.name] = ("SELECT",)
        elif role == "writer":
            update = WRITER_UPDATE_COLUMNS.get(table.name, "UPDATE")
            out[table.name] = ("SELECT", "INSERT") + (
                (update,) if table.name in WRITER_UPDATES else ()) + (
                ("DELETE",) if table.name in WRITER_DELETES else ())
        else:
            out[table.name] = ("SELECT", "INSERT", "UPDATE", "DELETE")
    out[ALEMBIC_TABLE] = ("SELECT",)  # written by schema upgrades only, which the owner runs
    return out


def sequence_privileges(role: str) -> dict[str, tuple[str, ...]]:
    """Sequence name -> the privileges ``role`` needs (inserting a row draws a value)."""
    check_role(role)
    if role == "reader":
        return {}
    return {seq: ("USAGE", "SELECT", "UPDATE") if role == "admin" else ("USAGE", "SELECT")
            for table in _tables() if role == "admin" or table.name not in GC_TABLES
            for seq in _sequences(table)}


def check_role(role: str) -> str:
    """Return ``role`` if it is one of :data:`ROLES`, else raise InvalidArgumentError."""
    if role not in ROLES:
        raise InvalidArgumentError(f"unknown role {role!r}: choose one of {', '.join(ROLES)}")
    return role


def check_role_name(name: str) -> str:
    """Return ``name`` if it is a plain lower-case PostgreSQL identifier, else raise."""
    if not _ROLE_NAME.match(name):
        raise InvalidArgumentError(
            f"role name {name!r}: use lower-case letters, digits and _ (at most 63, not starting "
            "with a digit), e.g. casckpt_writer")
    return name


def grant_statements(role: str, role_name: str | None = None, *, schema: str = "public") -> list[str]:
    """The PostgreSQL statements that give ``role_name`` (an existing role) ``role``'s rights.

    Comment lines start with ``--``; the rest are complete statements a superuser or the
    tables' owner runs (``psql -f``). Creates nothing but grants.
    """
    name = check_role_name(role_name or default_role_name(check_role(role)))
    check_role_name(schema)
    who = f'"{name}"'
    out = [f"-- casckpt {role} role for {who} (casckpt init --print-grants {role})",
           f'GRANT USAGE ON SCHEMA "{schema}" TO {who};']
    for table, privileges in table_privileges(role).items():
        out.append(f'GRANT {", ".join(privileges)} ON TABLE "{schema}"."{table}" TO {who};')
    for seq, privileges in sequence_privileges(role).items():
        out.append(f'GRANT {", ".join(privileges)} ON SEQUENCE "{schema}"."{seq}" TO {who};')
    if role == "writer":
        out += [f"-- UPDATE on {t}: {why}" for t, why in WRITER_UPDATES.items()]
        out += [f"-- DELETE on {t}: {why}" for t, why in WRITER_DELETES.items()]
    if role == "admin":
        out.append("-- schema upgrades (casckpt migrate) ALTER tables: run them as the tables' owner")
    return out


def _privilege_order(privilege: str) -> int:
    return ("DELETE", "UPDATE", "INSERT", "SELECT").index(privilege.split()[0])


def missing_rights(catalog: Catalog, role: str = "admin") -> list[str]:
    """The rights ``role`` needs that the catalog's credentials lack, deletions first
    (e.g. ``"DELETE on table packs"``); empty when all are held. Changes nothing.

    PostgreSQL: ``has_table_privilege`` / ``has_sequence_privilege`` for the current user.
    SQLite: the catalog file and its directory must be writable (a journal is created
    beside it). Other databases are not checked (empty).
    """
    wanted = sorted(((t, p) for t, ps in table_privileges(role).items() for p in ps),
                    key=lambda tp: _privilege_order(tp[1]))
    seqs = [(q, p) for q, ps in sequence_privileges(role).items() for p in ps]
    return missing_of(catalog, wanted, seqs)


def missing_of(catalog: Catalog, tables: Sequence[tuple[str, str]],
               sequences: Sequence[tuple[str, str]] = ()) -> list[str]:
    """Of the (table, privilege) and (sequence, privilege) pairs given, the rights the
    catalog's credentials lack (see :func:`missing_rights`). Changes nothing."""
    url = make_url(catalog.url)
    if url.get_backend_name() == "sqlite":
        return _sqlite_missing(url.database)
    if url.get_backend_name() != "postgresql":
        return []
    missing: list[str] = []
    with catalog.read() as conn:
        for table, privilege in tables:
            kind, _, columns = privilege.partition(" ")  # 'UPDATE ("value")': those columns'
            if columns:
                held: Any = all(conn.execute(text("SELECT has_column_privilege(:t, :c, :p)"),
                                        {"t": table, "c": column.strip(' ()"'), "p": kind}).scalar()
                           for column in columns.split(","))
            else:
                held = conn.execute(text("SELECT has_table_privilege(:t, :p)"),
                                    {"t": table, "p": privilege}).scalar()
            if not held:
                missing.append(f"{privilege} on table {table}")
        for seq, privilege in sequences:
            if not conn.execute(text("SELECT has_sequence_privilege(:q, :p)"),
                                {"q": seq, "p": privilege}).scalar():
                missing.append(f"{privilege} on sequence {seq}")
    return missing


def _sqlite_missing(database: str | None) -> list[str]:
    if not database or database == ":memory:":
        return []
    file = Path(database)
    missing: Sequence[tuple[Path, str]] = [
        (p, what) for p, what in ((file, "file"), (file.parent, "directory"))
        if not os.access(p, os.W_OK | (os.X_OK if what == "directory" else 0))]
    return [f"write access to the catalog {what} {p}" for p, what in missing]
