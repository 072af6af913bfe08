"""Catalog access: every SQL statement casckpt runs lives in this package.

Thread-safety: a :class:`Catalog` may be shared by threads; each call checks a
connection out of SQLAlchemy's pool for the duration of one transaction.

On SQLite, write transactions start with ``BEGIN IMMEDIATE`` so two writers
serialise on the database lock up front instead of failing on upgrade, and the
database runs in WAL mode with ``synchronous=FULL`` (a committed version
survives power loss).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Row,
    create_engine,
    event,
    func,
    select,
    text,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from casckpt.catalog import migrate
from casckpt.catalog import schema as s
from casckpt.errors import CatalogError, VersionExistsError
from casckpt.format.pack import PackEntry

BATCH = 500
_MIGRATION_LOCK = 0x6361736B  # "cask": PostgreSQL advisory lock key for schema upgrades


def _upsert_chunks(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """Insert chunk rows; a row GC has condemned, or whose pack is lost, is pointed at this
    new copy and made live.

    A live row is kept as it is (another writer stored the chunk first; this
    copy is dead space in its pack until repacking).
    """
    if not rows:
        return
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    stmt = dialect.insert(s.chunks)
    conn.execute(stmt.on_conflict_do_update(
        index_elements=["id"],
        set_={c: stmt.excluded[c] for c in ("pack_id", "offset", "stored_len", "raw_len", "codec",
                                             "base_id", "state", "created_at", "condemned_at")},
        where=(s.chunks.c.state == "condemned") | (s.chunks.c.state == "lost"),  # no IN: executemany
    ), rows)


class MissingChunksError(CatalogError):
    """A version references chunks the catalog does not hold live (e.g. removed by GC)."""

    def __init__(self, missing: set[str]) -> None:
        self.missing = missing
        super().__init__(f"{len(missing)} referenced chunks are not live in the catalog")


@dataclass(frozen=True, slots=True)
class ChunkLocation:
    """Where a live chunk's encoded bytes are."""

    chunk_id: str
    pack_id: str
    pack_key: str
    offset: int
    stored_len: int
    raw_len: int
    codec: int
    base_id: str | None = None  # the chunk a delta-coded chunk is decoded against

    def entry(self) -> PackEntry:
        """The pack entry this location describes."""
        return PackEntry(bytes.fromhex(self.chunk_id), self.offset, self.stored_len,
                         self.raw_len, self.codec, bytes.fromhex(self.base_id) if self.base_id else None)


@dataclass(frozen=True, slots=True)
class ShardRow:
    """Where one copy (``none``, ``replicate``) or shard (``ec``) of a pack lives.

    ``state`` is ``ok``, ``missing`` (not written, or found gone) or
    ``corrupt`` (found damaged); the last two are repair's queue.
    """

    index: int
    location_id: int
    key: str
    size: int
    checksum: str | None = None
    state: str = "ok"
    verified_at: float | None = None


@dataclass(frozen=True, slots=True)
class PackLayout:
    """How a pack is stored: its scheme and every shard.

    ``scheme`` is ``none``, ``replicate`` or ``ec``; for ``ec``, data shard
    ``i`` holds pack bytes ``[i*stripe, (i+1)*stripe)`` from payload byte
    ``data_offset`` (after the shard header).
    """

    id: str
    key: str
    size: int
    scheme: str = "none"
    k: int = 1
    m: int = 0
    algorithm: str | None = None
    stripe: int | None = None
    data_offset: int | None = None
    shards: tuple[ShardRow, ...] = ()

    def shard(self, index: int) -> ShardRow | None:
        """The shard with this index, if recorded."""
        return next((sh for sh in self.shards if sh.index == index), None)


@dataclass(frozen=True, slots=True)
class PackRecord:
    """A pack that has just been made durable in the blob store."""

    layout: PackLayout
    entries: Sequence[PackEntry]

    @property
    def id(self) -> str:
        """The pack id."""
        return self.layout.id

    @property
    def key(self) -> str:
        """The pack's base object key."""
        return self.layout.key

    @property
    def size(self) -> int:
        """The pack's length in bytes."""
        return self.layout.size


def insert_pack(conn: Connection, layout: PackLayout, chunks: int, now: float) -> None:
    """Insert a pack row and its shard rows (rows that exist are kept)."""
    insert_ignore(conn, s.packs, [{
        "id": layout.id, "key": layout.key, "size": layout.size, "chunks": chunks,
        "state": "live", "created_at": now, "verified_at": None, "scheme": layout.scheme,
        "k": layout.k, "m": layout.m, "algorithm": layout.algorithm, "stripe": layout.stripe,
        "data_offset": layout.data_offset,
    }], "id")
    rows = [{"pack_id": layout.id, "idx": sh.index, "location_id": sh.location_id, "key": sh.key,
             "size": sh.size, "checksum": sh.checksum, "state": sh.state, "verified_at": None}
            for sh in layout.shards]
    if rows:
        dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
        conn.execute(dialect.insert(s.shards).on_conflict_do_nothing(
            index_elements=["pack_id", "idx"]), rows)


def _sqlite_engine(url: str) -> Engine:
    engine = create_engine(url, connect_args={"timeout": 120, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=120000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        write = conn.get_execution_options().get("casckpt_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def insert_ignore(conn: Connection, table: Any, rows: list[dict[str, Any]], key: str) -> None:
    """INSERT rows, skipping those whose ``key`` exists (another writer got there first)."""
    if not rows:
        return
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    conn.execute(dialect.insert(table).on_conflict_do_nothing(index_elements=[key]), rows)


class Catalog:
    """The authoritative catalog (SQLite or PostgreSQL, via SQLAlchemy)."""

    def __init__(self, url: str, *, where: str) -> None:
        self.url = url
        self.where = where
        try:
            self.engine = _sqlite_engine(url) if url.startswith("sqlite") else create_engine(
                url, pool_pre_ping=True, pool_size=4, max_overflow=8
            )
            self._migrate()
            with self.read() as conn:
                self.store_id: str = conn.execute(
                    select(s.store_info.c.value).where(s.store_info.c.key == "store_id")
                ).scalar_one()
        except SQLAlchemyError as exc:
            raise CatalogError(f"cannot open the catalog at {where}: {exc}") from exc

    def _migrate(self) -> None:
        """Refuse a newer schema, then upgrade an older one; one process at a time.

        On PostgreSQL a session advisory lock serialises hosts opening the
        catalog at once; on SQLite ``BEGIN IMMEDIATE`` does.
        """
        with self.engine.connect().execution_options(casckpt_write=True) as conn:
            postgres = conn.dialect.name == "postgresql"
            if postgres:
                conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _MIGRATION_LOCK})
                conn.commit()
            try:
                with conn.begin():
                    migrate.check_not_newer(conn, self.where)
                migrate.upgrade(conn)
                conn.commit()
            finally:
                if postgres:
                    conn.rollback()
                    conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _MIGRATION_LOCK})
                    conn.commit()

    def close(self) -> None:
        """Dispose of pooled connections."""
        self.engine.dispose()

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A connection in a read transaction; SQL errors become CatalogError."""
        try:
            with self.engine.connect() as conn, conn.begin():
                yield conn
        except SQLAlchemyError as exc:
            raise CatalogError(f"catalog query failed at {self.where}: {exc}") from exc

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """A connection in a write transaction (SQLite: BEGIN IMMEDIATE), committed on exit."""
        try:
            with self.engine.connect().execution_options(casckpt_write=True) as conn:
                with conn.begin():
                    yield conn
        except SQLAlchemyError as exc:
            raise CatalogError(f"catalog update failed at {self.where}: {exc}") from exc

    # -- chunks and packs -------------------------------------------------

    def find_chunks(self, ids: Iterable[str], *, live_only: bool = True) -> dict[str, ChunkLocation]:
        """Return where each chunk among ``ids`` is.

        ``live_only`` (for dedup) skips chunks GC has condemned; readers pass
        False, since a condemned chunk is still stored until GC sweeps it.
        """
        wanted = list(dict.fromkeys(ids))
        found: dict[str, ChunkLocation] = {}
        query = select(
            s.chunks.c.id, s.chunks.c.pack_id, s.packs.c.key, s.chunks.c.offset,
            s.chunks.c.stored_len, s.chunks.c.raw_len, s.chunks.c.codec, s.chunks.c.base_id,
        ).join(s.packs, s.packs.c.id == s.chunks.c.pack_id)
        with self.read() as conn:
            for i in range(0, len(wanted), BATCH):
                batch = wanted[i : i + BATCH]
                where: list[ColumnElement[bool]] = [s.chunks.c.id.in_(batch)]
                if live_only:
                    where.append(s.chunks.c.state == "live")
                rows = conn.execute(query.where(*where))
                for row in rows:
                    found[row[0]] = ChunkLocation(*row)
        return found

    def add_pack(self, pack: PackRecord) -> None:
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
            _upsert_chunks(conn, chunk_rows)

    def revive_or_missing(self, conn: Connection, ids: list[str]) -> set[str]:
        """Revive referenced chunks GC condemned but has not swept, and the delta bases they
        need, transitively; return those (chunks or bases) that are gone."""
        wanted, missing = list(ids), set()
        seen = set(wanted)
        while wanted:
            bases: set[str] = set()
            for i in range(0, len(wanted), BATCH):
                batch = wanted[i : i + BATCH]
                condemned = s.chunks.c.id.in_(batch) & (s.chunks.c.state == "condemned")
                conn.execute(s.chunks.update().where(condemned).values(state="live", condemned_at=None))
                rows = conn.execute(
                    select(s.chunks.c.id, s.chunks.c.base_id)
                    .where(s.chunks.c.id.in_(batch), s.chunks.c.state == "live")
                    .with_for_update(read=True)  # PostgreSQL: GC cannot condemn them until we commit
                ).all()
                missing.update(set(batch) - {row[0] for row in rows})
                bases.update(row[1] for row in rows if row[1] is not None and row[1] not in seen)
            seen |= bases
            wanted = list(bases)
        return missing

    # -- versions -----------------------------------------------------------

    def add_version(
        self, version: dict[str, Any], run: str, tensor_rows: list[dict[str, Any]],
        content_rows: list[dict[str, Any]], tag_names: Sequence[str], chunk_ids: Iterable[str],
    ) -> None:
        """Make a version visible: ONE transaction that re-checks every referenced chunk.

        Raises:
            MissingChunksError: some referenced chunk is not live; nothing was written.
            VersionExistsError: the run already has a version at this step.
        """
        ids = list(dict.fromkeys(chunk_ids))
        try:
            with self.write() as conn:
                self._publish(conn, version, run, tensor_rows, content_rows, tag_names, ids)
        except CatalogError as exc:
            if isinstance(exc.__cause__, IntegrityError) and "uq_versions_run_step" in str(exc):
                raise VersionExistsError(
                    f"run {run!r} already has a version at step {version['step']} (committed "
                    "concurrently); commit with another step, or fork a new run"
                ) from exc
            raise

    def _publish(self, conn: Connection, version: dict[str, Any], run: str,
                 tensor_rows: list[dict[str, Any]], content_rows: list[dict[str, Any]],
                 tag_names: Sequence[str], ids: list[str]) -> None:
        run_id = self.run_id(conn, run, create=True)
        if run_id is None:
            raise CatalogError(f"run {run!r} vanished while committing; retry")
        # serialise commits to one run (PostgreSQL row lock; SQLite already holds the db lock)
        conn.execute(select(s.runs.c.id).where(s.runs.c.id == run_id).with_for_update())
        existing = conn.execute(select(s.versions.c.id).where(
            s.versions.c.run_id == run_id, s.versions.c.step == version["step"]
        )).scalar()
        if existing is not None:
            raise VersionExistsError(
                f"run {run!r} already has a version at step {version['step']} "
                f"({existing[:12]}); commit with another step, or fork a new run"
            )
        missing = self.revive_or_missing(conn, ids)
        if missing:
            raise MissingChunksError(missing)
        conn.execute(s.versions.insert().values(run_id=run_id, **version))
        for i in range(0, len(tensor_rows), BATCH):
            conn.execute(s.tensors.insert(), tensor_rows[i : i + BATCH])
        insert_ignore(conn, s.contents, content_rows, "digest")
        for name in tag_names:
            self._set_tag(conn, name, version["id"])

    def run_id(self, conn: Connection, run: str, *, create: bool) -> int | None:
        """The id of run ``run`` within ``conn``'s transaction (created if asked and missing)."""
        run_id = conn.execute(select(s.runs.c.id).where(s.runs.c.name == run)).scalar()
        if run_id is None and create:
            insert_ignore(conn, s.runs, [{"name": run, "created_at": time.time()}], "name")
            run_id = conn.execute(select(s.runs.c.id).where(s.runs.c.name == run)).scalar_one()
        return run_id

    def _set_tag(self, conn: Connection, name: str, version_id: str) -> None:
        conn.execute(s.tags.delete().where(s.tags.c.name == name))
        conn.execute(s.tags.insert().values(name=name, version_id=version_id, created_at=time.time()))

    def set_tag(self, name: str, version_id: str) -> None:
        """Point tag ``name`` at a version (moving it if it exists)."""
        with self.write() as conn:
            self._set_tag(conn, name, version_id)

    # -- queries ------------------------------------------------------------

    VERSION_COLS = (  # what a Version is built from, in this order
        s.versions.c.id, s.runs.c.name.label("run"), s.versions.c.step, s.versions.c.parent_id,
        s.versions.c.created_at, s.versions.c.logical_bytes, s.versions.c.new_bytes,
        s.versions.c.stored_bytes, s.versions.c.duration_s, s.versions.c.meta,
        s.versions.c.metrics, s.versions.c.message,
    )

    def _versions(self) -> Any:
        return select(*self.VERSION_COLS).join(s.runs, s.runs.c.id == s.versions.c.run_id).where(
            s.versions.c.state == "visible"
        )

    def version(self, version_id: str) -> Row[Any] | None:
        """The visible version with this exact id."""
        with self.read() as conn:
            return conn.execute(self._versions().where(s.versions.c.id == version_id)).first()

    def ids_with_prefix(self, prefix: str, limit: int = 5) -> list[str]:
        """Visible version ids starting with ``prefix``."""
        with self.read() as conn:
            return list(conn.execute(
                select(s.versions.c.id).where(
                    s.versions.c.id.startswith(prefix), s.versions.c.state == "visible"
                ).limit(limit)
            ).scalars())

    def at_step(self, run: str, step: int) -> Row[Any] | None:
        """The visible version of ``run`` at ``step``."""
        with self.read() as conn:
            return conn.execute(
                self._versions().where(s.runs.c.name == run, s.versions.c.step == step)
            ).first()

    def nth_latest(self, run: str, back: int) -> Row[Any] | None:
        """The visible version ``back`` versions before the latest of ``run`` (0: latest)."""
        with self.read() as conn:
            return conn.execute(
                self._versions().where(s.runs.c.name == run)
                .order_by(s.versions.c.step.desc()).offset(back).limit(1)
            ).first()

    def steps_near(self, run: str, step: int, limit: int = 3) -> list[int]:
        """The visible steps of ``run`` closest to ``step``."""
        with self.read() as conn:
            return list(conn.execute(
                select(s.versions.c.step).join(s.runs, s.runs.c.id == s.versions.c.run_id)
                .where(s.runs.c.name == run, s.versions.c.state == "visible")
                .order_by(func.abs(s.versions.c.step - step)).limit(limit)
            ).scalars())

    def log(self, run: str | None, limit: int | None) -> list[Row[Any]]:
        """Visible versions, newest first (by step within a run, by time across runs)."""
        query = self._versions()
        if run is not None:
            query = query.where(s.runs.c.name == run).order_by(s.versions.c.step.desc())
        else:
            query = query.order_by(s.versions.c.created_at.desc())
        with self.read() as conn:
            return list(conn.execute(query.limit(limit)))

    def run_names(self) -> list[str]:
        """Every run name."""
        with self.read() as conn:
            return list(conn.execute(select(s.runs.c.name).order_by(s.runs.c.name)).scalars())

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

    def tag_target(self, name: str) -> str | None:
        """The version id a tag points at."""
        with self.read() as conn:
            return conn.execute(select(s.tags.c.version_id).where(s.tags.c.name == name)).scalar()

    def tag_names(self) -> list[str]:
        """Every tag name."""
        with self.read() as conn:
            return list(conn.execute(select(s.tags.c.name).order_by(s.tags.c.name)).scalars())

    def tags_of(self, version_ids: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """Tag names per version id."""
        out: dict[str, list[str]] = {}
        with self.read() as conn:
            for i in range(0, len(version_ids), BATCH):
                rows = conn.execute(
                    select(s.tags.c.version_id, s.tags.c.name)
                    .where(s.tags.c.version_id.in_(version_ids[i : i + BATCH]))
                    .order_by(s.tags.c.name)
                )
                for vid, name in rows:
                    out.setdefault(vid, []).append(name)
        return {k: tuple(v) for k, v in out.items()}

    def manifest(self, version_id: str) -> bytes:
        """The compressed manifest of a version."""
        with self.read() as conn:
            data: bytes = conn.execute(
                select(s.versions.c.manifest).where(s.versions.c.id == version_id)
            ).scalar_one()
            return bytes(data)

    def tensors_of(self, version_id: str) -> list[Row[Any]]:
        """The tensor rows of a version, by path."""
        with self.read() as conn:
            return list(conn.execute(
                select(s.tensors).where(s.tensors.c.version_id == version_id)
                .order_by(s.tensors.c.path)
            ))

    def visible_version_ids(self) -> list[str]:
        """Ids of every visible version."""
        with self.read() as conn:
            return list(conn.execute(
                select(s.versions.c.id).where(s.versions.c.state == "visible")
            ).scalars())

    def packs(self) -> list[Row[Any]]:
        """Every live pack row."""
        with self.read() as conn:
            return list(conn.execute(select(s.packs).where(s.packs.c.state == "live")))

    def chunks_of_pack(self, pack_id: str) -> list[Row[Any]]:
        """Every chunk row stored in a pack, by offset."""
        with self.read() as conn:
            return list(conn.execute(
                select(s.chunks).where(s.chunks.c.pack_id == pack_id).order_by(s.chunks.c.offset)
            ))

    def live_chunk_batches(self, size: int = 10_000) -> Iterator[list[Any]]:
        """Every live chunk row, in batches by id (keyset pagination: bounded memory)."""
        after = ""
        while True:
            with self.read() as conn:
                batch = list(conn.execute(
                    select(s.chunks.c.id, s.chunks.c.pack_id, s.chunks.c.offset, s.chunks.c.stored_len,
                           s.chunks.c.raw_len, s.chunks.c.codec)
                    .where(s.chunks.c.state == "live", s.chunks.c.id > after)
                    .order_by(s.chunks.c.id).limit(size)))
            if not batch:
                return
            yield batch
            after = batch[-1].id

    def mark_verified(self, pack_ids: Sequence[str]) -> None:
        """Record that these packs were just read and verified in full."""
        now = time.time()
        with self.write() as conn:
            for i in range(0, len(pack_ids), BATCH):
                conn.execute(s.packs.update().where(s.packs.c.id.in_(pack_ids[i : i + BATCH]))
                             .values(verified_at=now))

    def totals(self) -> dict[str, int]:
        """Counts and byte sums for ``Store.stats``."""
        v, c, p = s.versions, s.chunks, s.packs
        with self.read() as conn:
            vrow = conn.execute(select(func.count(v.c.id), func.coalesce(func.sum(v.c.logical_bytes), 0))
                                .where(v.c.state == "visible")).one()
            crow = conn.execute(select(func.count(c.c.id), func.coalesce(func.sum(c.c.raw_len), 0),
                                       func.coalesce(func.sum(c.c.stored_len), 0))
                                .where(c.c.state == "live")).one()
            prow = conn.execute(select(func.count(p.c.id), func.coalesce(func.sum(p.c.size), 0))
                                .where(p.c.state == "live")).one()
            shard_bytes = conn.execute(select(func.coalesce(func.sum(s.shards.c.size), 0))
                                       .where(s.shards.c.state == "ok")).scalar_one()
            runs = conn.execute(select(func.count(s.runs.c.id))).scalar_one()
            tags = conn.execute(select(func.count(s.tags.c.name))).scalar_one()
        return {
            "runs": runs, "versions": vrow[0], "tags": tags, "chunks": crow[0], "packs": prow[0],
            "logical_bytes": int(vrow[1]), "unique_bytes": int(crow[1]),
            "stored_bytes": int(crow[2]), "pack_bytes": int(prow[1]),
            "location_bytes": int(shard_bytes),
        }
