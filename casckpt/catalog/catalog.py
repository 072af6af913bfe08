"""Catalog access: every SQL statement casckpt runs lives in this package.

Thread-safety: a :class:`Catalog` may be shared by threads; each call checks a
connection out of SQLAlchemy's pool for the duration of one transaction.

On SQLite, write transactions start with ``BEGIN IMMEDIATE`` so two writers
serialise on the database lock up front instead of failing on upgrade, and the
database runs in WAL mode with ``synchronous=FULL`` (a committed version
survives power loss).

Outages (see :mod:`casckpt.catalog.database`): an unreachable database raises
``CatalogUnavailableError``; the queries here and the idempotent updates
(``add_pack``, ``set_tag``, and ``add_version``, whose retry
recognises a publish that committed before its answer was lost) are retried
for up to ``retry_s`` seconds first.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Concatenate, ParamSpec, TypeVar

from sqlalchemy import ColumnElement, Connection, Row, func, select, text
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from casckpt.catalog import audit, migrate, treechanges
from casckpt.catalog import schema as s
from casckpt.catalog.database import Database, batches, sqlite_write_denied, upsert
from casckpt.catalog.encryption import require_state_in
from casckpt.catalog.packs import ChunkLocation, StoredPack, insert_pack, upsert_chunks
from casckpt.catalog.publishing import Publishing, insert_version
from casckpt.catalog.rows import VersionRow, manifest_bytes, tags_of, tensor_row, version_query, version_row
from casckpt.errors import CatalogError, CatalogUnavailableError, ReadOnlyStoreError
from casckpt.format.crypto import PLAIN, StoreCrypto
from casckpt.types import AuditEntry

DEFAULT_RETRY_S = 5.0

P = ParamSpec("P")
T = TypeVar("T")


def idempotent(method: Callable[Concatenate[Catalog, P], T]) -> Callable[Concatenate[Catalog, P], T]:
    """Mark a method, or a function taking the catalog first, safe to run again whole while
    the database is unreachable (its arguments must be re-iterable: a generator would be
    empty the second time)."""
    def retried(catalog: Catalog, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return catalog.retrying(lambda: method(catalog, *args, **kwargs))
    functools.update_wrapper(retried, method)
    return retried


class Catalog:
    """The authoritative catalog (SQLite or PostgreSQL, via SQLAlchemy).

    Raises (every method): CatalogUnavailableError when the database cannot
    be reached within ``retry_s`` seconds; CatalogError for other failures.
    """

    def __init__(self, url: str, *, where: str, retry_s: float = DEFAULT_RETRY_S,
                 read_only: bool | None = False) -> None:
        """Open the catalog, upgrading an older schema unless read-only.

        ``read_only``: True opens it for queries only (no migration; :meth:`write` refuses;
        SQLite opened ``mode=ro`` or ``immutable``, PostgreSQL sessions read-only); None
        decides by whether this process may write it (:attr:`write_denied` says why not);
        False writes as ever.

        Raises:
            ReadOnlyStoreError: read-only, and the schema is older than this casckpt's.
            SchemaTooNewError: the schema is newer than this casckpt's.
        """
        self.url = url
        self.where = where
        self.crypto: StoreCrypto = PLAIN  # set once by opening, for an encrypted store
        self.fast_tier: str | None = None  # this process's fast tier (engine/tiering/tier.py), set at open
        self.path_ids: dict[str, int] = {}  # tree_paths ids read or made by committed transactions
        self.upgraded_from: str | None = None  # the schema revision this open upgraded, if any
        self.write_denied: str | None = sqlite_write_denied(url) if read_only is None else None
        self._db = Database(url, where=where, retry_s=retry_s,
                            read_only=bool(read_only) or self.write_denied is not None)
        try:
            server = self._db.engine.dialect.name == "postgresql"
            if read_only is None and self.write_denied is None and server:
                self.write_denied = self.retrying(self._role_write_denied)
                if self.write_denied is not None:  # reopen with read-only sessions
                    self._db.close()
                    self._db = Database(url, where=where, retry_s=retry_s, read_only=True)
        except SQLAlchemyError as exc:
            self.close()
            raise self._db.error(exc, "opening the catalog") from exc
        self.read_only: bool = self._db.read_only
        self.engine = self._db.engine
        try:
            store_id = self.retrying(self._current_store_id)
            if store_id is None and self.read_only:
                self._refuse_migration()
            if store_id is None:  # new, older (or newer: refused) schema: Alembic decides
                self.upgraded_from = migrate.upgrade_once(self._db, where)
                store_id = self.retrying(self._read_store_id)
            self.store_id: str = store_id
        except SQLAlchemyError as exc:
            self.close()
            error = self._db.error(exc, "opening the catalog")
            if isinstance(error, CatalogUnavailableError):
                raise error from exc
            raise CatalogError(f"cannot open the catalog at {where}: {exc}") from exc
        except CatalogError:
            self.close()
            raise

    def _role_write_denied(self) -> str | None:
        """Why this PostgreSQL role cannot write the catalog (None: it may INSERT into every
        table a commit writes -- gc's own are the admin role's, ``OPTIONAL_TABLES`` a commit
        does without -- or there are none yet:
        creating them needs writing, and says so if denied).
        One query: the table names are the schema's own constants."""
        names = [t.name for t in s.metadata.sorted_tables
                 if t.name not in s.GC_TABLES | s.OPTIONAL_TABLES]
        may = ", ".join(f"CASE WHEN to_regclass('{n}') IS NULL THEN NULL "
                        f"ELSE has_table_privilege('{n}', 'INSERT') END" for n in names)
        with self.read() as conn:
            role, *allowed = conn.execute(text(f"SELECT current_user, {may}")).one()
        if allowed[names.index("versions")] is None:
            return None
        denied = [n for n, ok in zip(names, allowed, strict=True) if ok is False]
        if not denied:
            return None
        return (f"the PostgreSQL role {role!r} may not INSERT into the catalog tables "
                f"{', '.join(denied[:3])}{' ...' if len(denied) > 3 else ''} (if a casckpt upgrade "
                "added them since the role's grants were made, the tables' owner grants them by "
                "running the statements of `casckpt init --print-grants writer` again)")

    def _refuse_migration(self) -> None:
        """A read-only catalog at another schema revision: newer is refused as ever, older
        cannot be upgraded from here."""
        with self.read() as conn:
            migrate.check_not_newer(conn, self.where)
            stored = migrate.stored_revision(conn)
        raise ReadOnlyStoreError(
            f"the catalog at {self.where} is at schema revision {stored or 'none'}, older than "
            f"this casckpt's {migrate.shipped_head()}, and upgrading it needs write access; this "
            "store is opened read-only. Open it writable once (any casckpt command without "
            "--read-only, by a user who may write it), or run `casckpt migrate`",
            right="catalog:migrate")

    def _current_store_id(self) -> str | None:
        """The store id of a catalog at this casckpt's schema revision, in one read (None:
        the schema is another revision, or there is none yet)."""
        with self.read() as conn:
            if migrate.stored_revision(conn) != migrate.shipped_head():
                return None
            return self._store_id(conn)

    def _read_store_id(self) -> str:
        with self.read() as conn:
            return self._store_id(conn)

    @staticmethod
    def _store_id(conn: Connection) -> str:
        return str(conn.execute(
            select(s.store_info.c.value).where(s.store_info.c.key == "store_id")
        ).scalar_one())

    def require_crypto_in(self, conn: Connection) -> None:
        """Within a writer's transaction: the store's encryption is still :attr:`crypto`'s.

        Raises:
            StoreKeyError: it is not (see :func:`casckpt.catalog.encryption.require_state_in`).
        """
        require_state_in(conn, self.crypto.state, self.where)

    def retrying(self, operation: Callable[[], T]) -> T:
        """Run an idempotent catalog operation, again while the database is unreachable,
        for at most ``retry_s`` seconds (see :meth:`Database.retrying`)."""
        return self._db.retrying(operation)

    def close(self) -> None:
        """Dispose of pooled connections."""
        self._db.close()

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A connection in a read transaction; SQL errors become CatalogError (or
        CatalogUnavailableError); getting the connection is retried, the body runs once."""
        with self._db.transaction(write=False) as conn:
            yield conn

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """A connection in a write transaction (SQLite: BEGIN IMMEDIATE), committed on exit.

        Raises:
            ReadOnlyStoreError: the catalog was opened read-only (the last line of defence:
                the store refuses write calls before they get here).
        """
        if self.read_only:
            raise ReadOnlyStoreError(
                f"writing to the catalog at {self.where} needs write access; it was opened "
                "read-only", right="catalog:write")
        with self._db.transaction(write=True) as conn:
            yield conn

    # -- audit trail --------------------------------------------------------

    audit_enabled: bool = True
    """Whether :meth:`record_audit` and :meth:`audit_in` write rows. A read-only open sets it
    False on its catalog (it never writes: every change it would record is refused anyway)."""

    def record_audit(self, action: str, target: str | None = None,
                     detail: Mapping[str, object] | None = None) -> None:
        """Add one row to the audit trail, in a transaction of its own.

        For changes made outside the catalog, once they are done; a change the catalog makes
        records itself inside its own transaction with :meth:`audit_in`. Example (the
        encryption work)::

            catalog.record_audit("key.rotate", None, {"key_id": new_id, "previous": old_id})

        Args:
            action: what was done, at most 64 characters; dotted families
                (``key.add``, ``key.remove``) filter together (``casckpt audit --action key``).
            target: what it was done to (a version id, ``run:NAME``, ``tag:NAME``,
                ``location:NAME``, ``key:ID``), or None for the whole store.
            detail: JSON-able particulars; never secrets (the catalog is plaintext).

        Who (OS user, host, pid; on PostgreSQL the role), when, and the casckpt version are
        filled in. A no-op while :attr:`audit_enabled` is False.

        Raises:
            InvalidArgumentError: ``action`` is empty or too long (a ValueError).
            CatalogError, CatalogUnavailableError: the row could not be written.
        """
        if not self.audit_enabled:
            return
        with self.write() as conn:
            audit.add(conn, action, target, detail)

    def audit_in(self, conn: Connection, action: str, target: str | None = None,
                 detail: Mapping[str, object] | None = None) -> None:
        """:meth:`record_audit` inside ``conn``'s write transaction: the row commits, or
        rolls back, with the change it records (so no change is visible without its row)."""
        if self.audit_enabled:
            audit.add(conn, action, target, detail)

    @idempotent
    def audit_entries(self, *, since: float | None = None, until: float | None = None,
                      action: str | None = None, target: str | None = None,
                      limit: int | None = None) -> list[AuditEntry]:
        """Audit rows oldest first (see :func:`casckpt.catalog.audit.entries`)."""
        with self.read() as conn:
            return audit.entries(conn, since=since, until=until, action=action, target=target,
                                 limit=limit)

    # -- chunks and packs -------------------------------------------------

    def find_chunks(self, ids: Iterable[str], *, live_only: bool = True) -> dict[str, ChunkLocation]:
        """Return where each chunk among ``ids`` is.

        ``live_only`` (for dedup) skips chunks GC has condemned; readers pass
        False, since a condemned chunk is still stored until GC sweeps it.
        """
        wanted = list(dict.fromkeys(ids))
        return self.retrying(lambda: self._find_chunks(wanted, live_only))

    def _find_chunks(self, wanted: list[str], live_only: bool) -> dict[str, ChunkLocation]:
        found: dict[str, ChunkLocation] = {}
        query = select(
            s.chunks.c.id, s.chunks.c.pack_id, s.packs.c.key, s.chunks.c.offset,
            s.chunks.c.stored_len, s.chunks.c.raw_len, s.chunks.c.codec, s.chunks.c.base_id,
        ).join(s.packs, s.packs.c.id == s.chunks.c.pack_id)
        with self.read() as conn:
            for batch in batches(wanted):
                where: list[ColumnElement[bool]] = [s.chunks.c.id.in_(batch)]
                if live_only:  # dedup: not against other hosts' fast tiers, which may be lost
                    where.append(s.chunks.c.state == "live")
                    where.append(s.packs.c.state == "live" if self.fast_tier is None else
                                 (s.packs.c.state == "live") | (s.packs.c.tier == self.fast_tier))
                rows = conn.execute(query.where(*where))
                for row in rows:
                    found[row[0]] = ChunkLocation(*row)
        return found

    @idempotent  # rows that exist are kept
    def add_pack(self, pack: StoredPack) -> None:
        """Record a durable pack and its chunks (chunks another writer already recorded are kept)."""
        now = time.time()
        chunk_rows = [
            {"id": e.chunk_id.hex(), "pack_id": pack.id, "offset": e.offset,
             "stored_len": e.stored_len, "raw_len": e.raw_len, "codec": e.codec,
             "base_id": e.base_id.hex() if e.base_id else None, "state": "live", "created_at": now,
             "condemned_at": None}
            for e in pack.entries
        ]
        with self.write() as conn:
            insert_pack(conn, pack.layout, len(pack.entries), now)
            upsert_chunks(conn, chunk_rows)

    # -- versions -----------------------------------------------------------

    def add_version(
        self, version: dict[str, Any], run: str, tensor_rows: list[dict[str, Any]],
        content_rows: list[dict[str, Any]], tag_names: Sequence[str], chunk_ids: Iterable[str],
        node_rows: Sequence[dict[str, Any]] = (), lease: str | None = None, audit: bool = True,
        tree_changes: Sequence[treechanges.Change] | None = None,
    ) -> bool:
        """Make a version visible: ONE transaction that re-checks every referenced chunk.
        Returns whether this call published it (False: another writer published the same
        version first -- a concurrent copy --; nothing but the lease's end was written).

        ``tree_changes``: a tree version's rows of :mod:`casckpt.catalog.treechanges` (None:
        not known, none recorded).

        The same transaction adds the ``commit`` row of the audit trail (and ``run.create``
        for a new run): a version is visible exactly when its row exists. ``audit=False``
        (a catalog rebuild, which records itself once) leaves them out.

        ``lease``: the commit's lease, ended in the same transaction (once the version is
        visible it keeps its chunks itself; a failed publish leaves the lease as it was).

        A tree version (``version["tree_root"]``) also passes the rows of the nodes the
        catalog lacks (``node_rows``: id, zstd body); ``chunk_ids`` are all of its chunks
        and nodes, as for any version (gc condemns by age, so a live node may sit over
        condemned chunks: only re-checking each one revives them).

        Retried while the database is unreachable: a retry that finds this
        version's id already published knows the earlier COMMIT succeeded.

        Raises:
            MissingChunksError: some referenced chunk is not live; nothing was written.
            VersionExistsError: the run already has a version at this step.
            CatalogUnavailableError: the database stayed unreachable; the version is not
                visible, unless the error is ``in_doubt`` (lost while committing).
        """
        attempt = Publishing(self, version, run, (tensor_rows, content_rows, node_rows), tag_names,
                             list(dict.fromkeys(chunk_ids)), lease, audit, tree_changes)
        try:
            self.retrying(attempt.publish)
        except CatalogUnavailableError as exc:
            raise attempt.unavailable(exc) from exc
        except CatalogError as exc:
            if isinstance(exc.__cause__, IntegrityError) and "uq_versions_run_step" in str(exc):
                raise attempt.step_taken() from exc
            raise
        self.path_ids.update(attempt.interned)  # committed: the ids keep their paths
        return attempt.published

    def _publish(self, conn: Connection, version: dict[str, Any], run: str,
                 tensor_rows: list[dict[str, Any]], content_rows: list[dict[str, Any]],
                 tag_names: Sequence[str], ids: list[str],
                 node_rows: Sequence[dict[str, Any]] = (), audit: bool = True) -> bool:
        """Publish within ``conn``; False: it was visible already (:func:`publish.insert_version`)."""
        return insert_version(self, conn, version, run, (tensor_rows, content_rows, node_rows),
                              tag_names, ids, audit)

    def run_id(self, conn: Connection, run: str, *, create: bool, audit: bool = True) -> int | None:
        """The id of run ``run`` within ``conn``'s transaction (created if asked and missing;
        a run this call creates is recorded as ``run.create`` unless ``audit`` is False)."""
        run_id = conn.execute(select(s.runs.c.id).where(s.runs.c.name == run)).scalar()
        if run_id is None and create:
            created = conn.execute(
                upsert(conn, s.runs).on_conflict_do_nothing(index_elements=["name"])
                .values(name=run, created_at=time.time()).returning(s.runs.c.id)).first()
            if created is not None and audit:
                self.audit_in(conn, "run.create", f"run:{run}")
            run_id = conn.execute(select(s.runs.c.id).where(s.runs.c.name == run)).scalar_one()
        return run_id

    def _set_tag(self, conn: Connection, name: str, version_id: str) -> None:
        # moved by UPDATE, never DELETE + INSERT: the writer role may not delete catalog rows
        moved = conn.execute(s.tags.update().where(s.tags.c.name == name)
                             .values(version_id=version_id, created_at=time.time())).rowcount
        if not moved:
            conn.execute(s.tags.insert().values(name=name, version_id=version_id, created_at=time.time()))

    @idempotent  # a retry after a lost COMMIT finds the tag in place: nothing more recorded
    def set_tag(self, name: str, version_id: str) -> None:
        """Point tag ``name`` at a version (moving it if it exists), recorded as ``tag``
        (with the version it pointed at before, ``moved_from``) unless it pointed there."""
        with self.write() as conn:
            before = conn.execute(select(s.tags.c.version_id).where(s.tags.c.name == name)).scalar()
            if before == version_id:
                return
            self._set_tag(conn, name, version_id)
            self.audit_in(conn, "tag", f"tag:{name}", {"version": version_id, "moved_from": before})

    # -- queries ------------------------------------------------------------

    @idempotent
    def version(self, version_id: str) -> VersionRow | None:
        """The visible version with this exact id."""
        with self.read() as conn:
            return version_row(conn.execute(version_query().where(s.versions.c.id == version_id)).first())

    @idempotent
    def ids_with_prefix(self, prefix: str, limit: int = 5) -> list[str]:
        """Visible version ids starting with ``prefix``."""
        with self.read() as conn:
            return list(conn.execute(
                select(s.versions.c.id).where(
                    s.versions.c.id.startswith(prefix), s.versions.c.state == "visible"
                ).limit(limit)
            ).scalars())

    @idempotent
    def at_step(self, run: str, step: int) -> VersionRow | None:
        """The visible version of ``run`` at ``step``."""
        with self.read() as conn:
            return version_row(conn.execute(
                version_query().where(s.runs.c.name == run, s.versions.c.step == step)
            ).first())

    @idempotent
    def nth_latest(self, run: str, back: int) -> VersionRow | None:
        """The visible version ``back`` versions before the latest of ``run`` (0: latest)."""
        with self.read() as conn:
            return version_row(conn.execute(
                version_query().where(s.runs.c.name == run)
                .order_by(s.versions.c.step.desc()).offset(back).limit(1)
            ).first())

    @idempotent
    def steps_near(self, run: str, step: int, limit: int = 3) -> list[int]:
        """The visible steps of ``run`` closest to ``step``."""
        with self.read() as conn:
            return list(conn.execute(
                select(s.versions.c.step).join(s.runs, s.runs.c.id == s.versions.c.run_id)
                .where(s.runs.c.name == run, s.versions.c.state == "visible")
                .order_by(func.abs(s.versions.c.step - step)).limit(limit)
            ).scalars())

    @idempotent
    def run_names(self) -> list[str]:
        """Every run name."""
        with self.read() as conn:
            return list(conn.execute(select(s.runs.c.name).order_by(s.runs.c.name)).scalars())

    @idempotent
    def runs(self) -> list[tuple[Any, ...]]:
        """Each run with its version count, latest step and logical bytes."""
        v, newest = s.versions, s.versions.alias("newest")
        latest = (
            select(newest.c.id).where(newest.c.run_id == s.runs.c.id, newest.c.state == "visible")
            .order_by(newest.c.step.desc()).limit(1).correlate(s.runs).scalar_subquery()
        )
        query = (
            select(
                s.runs.c.name, s.runs.c.created_at,
                func.count(v.c.id), func.max(v.c.step), latest,
                func.coalesce(func.sum(v.c.logical_bytes), 0),
            )
            .select_from(s.runs.outerjoin(v, (v.c.run_id == s.runs.c.id) & (v.c.state == "visible")))
            .group_by(s.runs.c.id, s.runs.c.name, s.runs.c.created_at)
            .order_by(s.runs.c.name)
        )
        with self.read() as conn:
            return [tuple(row) for row in conn.execute(query)]

    @idempotent
    def tag_target(self, name: str) -> str | None:
        """The version id a tag points at."""
        with self.read() as conn:
            return conn.execute(select(s.tags.c.version_id).where(s.tags.c.name == name)).scalar()

    @idempotent
    def tag_names(self) -> list[str]:
        """Every tag name."""
        with self.read() as conn:
            return list(conn.execute(select(s.tags.c.name).order_by(s.tags.c.name)).scalars())

    @idempotent
    def tags_of(self, version_ids: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """Tag names per version id."""
        with self.read() as conn:
            return tags_of(conn, version_ids)

    @idempotent
    def manifest(self, version_id: str) -> bytes:
        """The compressed manifest of a version."""
        with self.read() as conn:
            data = conn.execute(
                select(s.versions.c.manifest).where(s.versions.c.id == version_id)
            ).scalar_one()
            return manifest_bytes(data, version_id)

    @idempotent
    def tensors_of(self, version_id: str) -> list[Row[Any]]:
        """The tensor rows of a version, by path."""
        with self.read() as conn:
            return [tensor_row(row) for row in conn.execute(
                select(s.tensors).where(s.tensors.c.version_id == version_id)
                .order_by(s.tensors.c.path)
            )]
