"""One :meth:`~casckpt.catalog.catalog.Catalog.add_version` call across its tries.

The publishing transaction may be retried while the database is unreachable. A try whose
COMMIT was lost on its way (``in_doubt``) may or may not have committed; the retry that
finds the version already visible tells which by the commit's lease, ended in the same
transaction: nothing left to delete means our earlier try committed, a lease still there
means another writer (a concurrent copy) published the version first. Without a lease the
retry cannot tell and counts the version as its own.

Each try starts afresh: the ``tree_paths`` ids a rolled-back try interned name nothing
(the database may give them to other paths), so only the committed try's ids are kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from sqlalchemy import Connection, select

from casckpt.catalog import schema as s
from casckpt.catalog import tensorchanges, treechanges
from casckpt.catalog.database import batches, insert_ignore
from casckpt.catalog.publish import MissingChunksError, insert_deps, revive_or_missing
from casckpt.errors import CatalogError, CatalogUnavailableError, VersionExistsError


class Catalog(Protocol):
    """What publishing uses of :class:`~casckpt.catalog.catalog.Catalog` (passed in: that
    module imports this one)."""

    path_ids: dict[str, int]

    def write(self) -> AbstractContextManager[Connection]: ...

    def require_crypto_in(self, conn: Connection) -> None: ...

    def run_id(self, conn: Connection, run: str, *, create: bool, audit: bool = True) -> int | None: ...

    def audit_in(self, conn: Connection, action: str, target: str | None = None,
                 detail: Mapping[str, object] | None = None) -> None: ...

    def _set_tag(self, conn: Connection, name: str, version_id: str) -> None: ...

    def _publish(self, conn: Connection, version: dict[str, Any], run: str,
                 tensor_rows: list[dict[str, Any]], content_rows: list[dict[str, Any]],
                 tag_names: Sequence[str], ids: list[str],
                 node_rows: Sequence[dict[str, Any]] = (), audit: bool = True) -> bool: ...


class Publishing:
    """The state of one ``add_version`` call: ``publish`` is one try (retried whole)."""

    def __init__(self, catalog: Catalog, version: dict[str, Any], run: str,
                 rows: tuple[list[dict[str, Any]], list[dict[str, Any]], Sequence[dict[str, Any]]],
                 tag_names: Sequence[str], ids: list[str], lease: str | None, audit: bool,
                 tree_changes: Sequence[treechanges.Change] | None) -> None:
        self.catalog, self.version, self.run = catalog, version, run
        self.tensor_rows, self.content_rows, self.node_rows = rows
        self.tag_names, self.ids, self.lease, self.audit = tag_names, ids, lease, audit
        self.tree_changes = tree_changes
        self.in_doubt = False  # a try lost its connection while COMMIT was on its way
        self.published = False
        self.interned: dict[str, int] = {}  # the committed try's new tree_paths ids

    def publish(self) -> None:
        """One try, in one transaction."""
        self.interned = {}  # a rolled-back try's ids may belong to other paths by now
        catalog = self.catalog
        try:
            with catalog.write() as conn:
                ended = True  # rolled back with the rest if publishing fails
                if self.lease is not None:
                    ended = conn.execute(s.leases.delete().where(s.leases.c.id == self.lease)).rowcount > 0
                inserted = catalog._publish(conn, self.version, self.run, self.tensor_rows,
                                            self.content_rows, self.tag_names, self.ids,
                                            self.node_rows, self.audit)
                # found visible: ours only if an earlier try's COMMIT was in doubt and, with a
                # lease, that try ended it (a lease still there: another writer published it)
                self.published = inserted or (self.in_doubt and (self.lease is None or not ended))
                if inserted and self.tree_changes is not None:
                    version = self.version
                    self.interned = treechanges.insert(conn, version["id"], version.get("parent_id"),
                                                       self.tree_changes, catalog.path_ids)
        except CatalogUnavailableError as exc:
            self.in_doubt = self.in_doubt or exc.in_doubt
            raise

    def unavailable(self, exc: CatalogUnavailableError) -> CatalogUnavailableError:
        """The error to raise when the database stayed unreachable."""
        version, run = self.version, self.run
        short = version["id"][:12]
        if self.in_doubt:
            error = CatalogUnavailableError(
                f"could not confirm version {short} ({run}@{version['step']}): {exc}. The "
                f"connection was lost while the database committed it, so it may be visible "
                f"(whole and correct if so): `casckpt show {short}` tells once the database "
                f"is back")
            error.in_doubt = True
            return error
        return CatalogUnavailableError(
            f"could not publish version {short} ({run}@{version['step']}): {exc}. It is not visible")

    def step_taken(self) -> VersionExistsError:
        return VersionExistsError(
            f"run {self.run!r} already has a version at step {self.version['step']} (committed "
            "concurrently); commit with another step, or fork a new run")


def insert_version(catalog: Catalog, conn: Connection, version: dict[str, Any], run: str,
                   rows: tuple[list[dict[str, Any]], list[dict[str, Any]], Sequence[dict[str, Any]]],
                   tag_names: Sequence[str], ids: list[str], audit: bool = True) -> bool:
    """Publish within ``conn`` (rows: tensors, contents, tree nodes); False: the version was
    visible already (an earlier try's answer was lost, or another writer published it)."""
    tensor_rows, content_rows, node_rows = rows
    catalog.require_crypto_in(conn)  # never a version its store cannot read
    run_id = catalog.run_id(conn, run, create=True, audit=audit)
    if run_id is None:
        raise CatalogError(f"run {run!r} vanished while committing; retry")
    # serialise commits to one run (PostgreSQL row lock; SQLite already holds the db lock)
    conn.execute(select(s.runs.c.id).where(s.runs.c.id == run_id).with_for_update())
    existing = conn.execute(select(s.versions.c.id).where(
        s.versions.c.run_id == run_id, s.versions.c.step == version["step"]
    )).scalar()
    if existing == version["id"]:
        return False
    if existing is not None:
        raise VersionExistsError(
            f"run {run!r} already has a version at step {version['step']} "
            f"({existing[:12]}); commit with another step, or fork a new run"
        )
    needed: set[str] = set()  # its chunks and their delta bases: all are read to restore it
    missing = revive_or_missing(conn, ids, needed)
    if missing:
        raise MissingChunksError(missing)
    conn.execute(s.versions.insert().values(run_id=run_id, **version))
    if insert_deps(conn, version["id"], sorted(needed)):  # it needs a pack still on a fast tier
        version["durability"] = "fast"
    parent = version.get("parent_id")
    for batch in batches(tensorchanges.with_changed_bytes(conn, parent, tensor_rows, content_rows)):
        conn.execute(s.tensors.insert(), batch)
    insert_ignore(conn, s.contents, content_rows, "digest")
    insert_ignore(conn, s.tree_nodes, list(node_rows), "id")
    for name in tag_names:
        catalog._set_tag(conn, name, version["id"])
    if audit:
        catalog.audit_in(conn, "commit", version["id"], {
            "run": run, "step": version["step"], "new_bytes": version["new_bytes"],
            "stored_bytes": version["stored_bytes"], "logical_bytes": version["logical_bytes"],
            "tags": list(tag_names)})
    return True
