"""The SQL side of garbage collection: mark, condemn, revive, sweep, purge, repack.

Referenced chunk ids are collected into the ``gc_live`` table in batches, so
the set work happens in the database and GC's memory stays bounded however
large the store is. Every function is one or a few short transactions; none
deletes an object (the engine does that after the rows are gone). The GC lock is
in :mod:`casckpt.catalog.locks`; the leases that keep commits in flight safe
from a collection are in :mod:`casckpt.catalog.leases`.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Text, and_, bindparam, cast, delete, exists, func, insert, or_, select, text, update

from casckpt.catalog import schema as s
from casckpt.catalog import treechanges
from casckpt.catalog.audit import who
from casckpt.catalog.catalog import Catalog
from casckpt.catalog.database import batches, insert_ignore
from casckpt.catalog.leases import tombstone
from casckpt.catalog.packs import PackLayout, StoredPack, insert_pack
from casckpt.catalog.shards import layouts_in
from casckpt.catalog.tiers import forget_deps
from casckpt.errors import CatalogError
from casckpt.types import GCRun

_CHUNK_OVERHEAD = 92 + 90  # a chunk's entry header and footer entry in its pack (format/pack.py)


@dataclass(frozen=True, slots=True)
class DeadPack:
    """A pack the catalog no longer references; its objects may be deleted once GC has
    checked (from the pack's footer) that none holds a chunk a version still needs."""

    id: str
    key: str
    size: int
    layout: PackLayout | None = None  # as the catalog had it (None if it had no shard rows)

    @property
    def shards(self) -> tuple[tuple[int, str], ...]:
        """(location id, object name) of every shard."""
        return tuple((sh.location_id, sh.key) for sh in self.layout.shards) if self.layout else ()


def start_run(catalog: Catalog, dry_run: bool) -> int:
    """Record the start of a GC run; returns its id."""
    me = who()
    with catalog.write() as conn:
        key = conn.execute(insert(s.gc_runs).values(
            started_at=time.time(), host=me.host, pid=me.pid,
            dry_run=dry_run,
        )).inserted_primary_key
    if key is None:
        raise CatalogError("the catalog did not return the id of the new gc run")
    return int(key[0])


def finish_run(catalog: Catalog, run_id: int, report: dict[str, Any]) -> None:
    """Record the end of a GC run and its report (a run that changed anything, not a dry
    run, also as a ``gc`` audit row: its counts and bytes, the objects it kept but not their
    names)."""
    with catalog.write() as conn:
        conn.execute(update(s.gc_runs).where(s.gc_runs.c.id == run_id)
                     .values(finished_at=time.time(), report=report))
        if not report.get("dry_run"):
            summary = {k: v for k, v in report.items() if k != "kept"}
            catalog.audit_in(conn, "gc", None, {**summary, "gc_run": run_id,
                                                "kept": len(report.get("kept") or ())})


def fail_run(catalog: Catalog, run_id: int, counts: dict[str, Any], error: str) -> None:
    """Record a GC run that stopped on ``error`` after doing what ``counts`` says (versions it
    purged, objects it deleted): its ``gc_runs`` row finished, and a ``gc`` audit row with
    ``failed`` set -- a purge is never unaccounted for because the run did not finish."""
    with catalog.write() as conn:
        conn.execute(update(s.gc_runs).where(s.gc_runs.c.id == run_id)
                     .values(finished_at=time.time(), report={**counts, "failed": error}))
        catalog.audit_in(conn, "gc", None, {**counts, "gc_run": run_id, "failed": error})


RUN_COUNTS = ("versions_deleted", "versions_purged", "chunks_swept", "packs_deleted",
              "orphans_deleted", "bytes_freed")
"""The counts a run's ``gc_runs`` row adds up while it runs (:func:`count_in_run`)."""


def count_in_run(conn: Any, run_id: int | None, **done: int) -> None:
    """Add ``done`` (names from :data:`RUN_COUNTS`) to the counts of gc run ``run_id``, in the
    caller's transaction -- the one that deletes what they count, so a run killed with -9
    has recorded exactly what it committed. ``None`` (a dry run) records nothing."""
    if run_id is None or not any(done.values()):
        return
    runs = s.gc_runs
    report = conn.execute(select(runs.c.report).where(runs.c.id == run_id)).scalar_one_or_none()
    counts = dict(report or {})
    for name, n in done.items():
        counts[name] = int(counts.get(name) or 0) + n
    conn.execute(update(runs).where(runs.c.id == run_id).values(report=counts))


def runs_since(catalog: Catalog, since: float | None) -> list[GCRun]:
    """The gc runs (not dry runs) started at or after ``since``, oldest first, each with what
    it committed: a finished or failed run's report, a killed one's counts so far."""
    runs = s.gc_runs
    query = select(runs).where(runs.c.dry_run.is_(False)).order_by(runs.c.id)
    if since is not None:
        query = query.where(runs.c.started_at >= since)
    with catalog.read() as conn:
        rows = conn.execute(query).all()
    out = []
    for r in rows:
        report = dict(r.report or {})
        outcome = ("unfinished" if r.finished_at is None else
                   "failed" if report.get("failed") else "finished")
        out.append(GCRun(
            id=int(r.id), started_at=float(r.started_at),
            finished_at=None if r.finished_at is None else float(r.finished_at),
            host=str(r.host), pid=int(r.pid), outcome=outcome,
            error=str(report["failed"]) if report.get("failed") else None,
            **{name: int(report.get(name) or 0) for name in RUN_COUNTS}))
    return out


def expired_deleted_versions(catalog: Catalog, cutoff: float) -> list[str]:
    """Ids of soft-deleted versions whose grace period has passed."""
    with catalog.read() as conn:
        return list(conn.execute(select(s.versions.c.id).where(
            s.versions.c.state == "deleted", s.versions.c.deleted_at <= cutoff
        )).scalars())


def purge_versions(catalog: Catalog, version_ids: list[str], run_id: int | None = None) -> list[str]:
    """Remove soft-deleted versions (their tags, tensor rows, and contents no one uses).

    A version undeleted meanwhile is left alone: each batch re-reads, under
    row locks, which versions are still deleted. Each batch is counted in gc run ``run_id``'s
    row in its own transaction. Returns the ids purged.
    """
    v, t = s.versions, s.tensors
    purged: list[str] = []
    for wanted in batches(version_ids):
        with catalog.write() as conn:
            batch = list(conn.execute(select(v.c.id).where(
                v.c.id.in_(wanted), v.c.state == "deleted"
            ).with_for_update()).scalars())
            conn.execute(delete(s.tags).where(s.tags.c.version_id.in_(batch)))
            conn.execute(delete(t).where(t.c.version_id.in_(batch)))
            treechanges.forget(conn, batch)
            forget_deps(conn, batch)
            conn.execute(delete(v).where(v.c.id.in_(batch)))
            tombstone(conn, batch, "purged")
            count_in_run(conn, run_id, versions_purged=len(batch))
            purged += batch
    with catalog.write() as conn:
        drop_unused_contents(conn)
    return purged


def drop_unused_contents(conn: Any, digests: Collection[str] | None = None) -> None:
    """Delete the ``contents`` rows no tensor row uses (only among ``digests`` when given),
    within the caller's transaction."""
    if conn.dialect.name == "postgresql":  # a commit must not add a user of a row we drop
        conn.execute(text("LOCK TABLE tensors IN SHARE MODE"))
    c = s.contents
    unused = ~exists().where(s.tensors.c.digest == c.c.digest)
    if digests is None:
        conn.execute(delete(c).where(unused))
        return
    for batch in batches(list(dict.fromkeys(digests))):
        conn.execute(delete(c).where(c.c.digest.in_(batch), unused))


def clear_live(catalog: Catalog) -> None:
    """Empty GC's mark set before a mark."""
    with catalog.write() as conn:
        conn.execute(delete(s.gc_live))


def add_live(catalog: Catalog, ids: Collection[str]) -> None:
    """Add referenced chunk ids to GC's mark set."""
    if ids:
        with catalog.write() as conn:
            insert_ignore(conn, s.gc_live, [{"id": i} for i in set(ids)], "id")


def visible_ids(catalog: Catalog) -> set[str]:
    """Ids of every visible version."""
    with catalog.read() as conn:
        return set(conn.execute(select(s.versions.c.id).where(s.versions.c.state == "visible")).scalars())


def visible_roots(catalog: Catalog) -> dict[str, str | None]:
    """Every visible version's id -> its tree root (None: no tree)."""
    with catalog.read() as conn:
        rows = conn.execute(select(s.versions.c.id, s.versions.c.tree_root)
                            .where(s.versions.c.state == "visible")).all()
    return {r[0]: r[1] for r in rows}


def manifest_batches(catalog: Catalog, version_ids: Collection[str], size: int = 100) -> Iterator[list[Any]]:
    """Rows (id, run, step, parent_id, created_at, manifest, tree_root, meta_text, metrics_text,
    durability) of these versions, ``size`` at a time (bounded memory); versions that vanished
    meanwhile are left out. Metadata and metrics come as text, undecoded (check compares them
    with the manifest)."""
    v = s.versions
    query = select(v.c.id, s.runs.c.name.label("run"), v.c.step, v.c.parent_id, v.c.created_at,
                   v.c.manifest, v.c.tree_root, cast(v.c.meta, Text).label("meta_text"),
                   cast(v.c.metrics, Text).label("metrics_text"), v.c.durability,
                   ).join(s.runs, s.runs.c.id == v.c.run_id)
    for batch in batches(sorted(version_ids), size):
        with catalog.read() as conn:
            yield list(conn.execute(query.where(v.c.id.in_(batch))))


def replace_manifest(catalog: Catalog, version_id: str, data: bytes) -> None:
    """Put a verified copy of a version's manifest in place of the catalog's damaged one."""
    with catalog.write() as conn:
        conn.execute(update(s.versions).where(s.versions.c.id == version_id).values(manifest=data))


def marked(catalog: Catalog, ids: Collection[str]) -> set[str]:
    """Which of these chunk ids the mark set holds."""
    found: set[str] = set()
    with catalog.read() as conn:
        for batch in batches(list(ids)):
            found.update(conn.execute(select(s.gc_live.c.id).where(s.gc_live.c.id.in_(batch))).scalars())
    return found


def mark_bases(catalog: Catalog, *, created_after: float) -> int:
    """Add to ``gc_live`` every delta base a marked chunk needs, transitively -- and those of
    live chunks made after ``created_after`` (a commit in flight may still publish them).

    Returns how many chunks are live only as bases (of versions still visible, or in flight).
    """
    c, live = s.chunks, s.gc_live
    needs = c.c.base_id.is_not(None) & ~exists().where(live.c.id == c.c.base_id)
    users = exists().where(live.c.id == c.c.id)
    seed = and_(c.c.state == "live", c.c.created_at >= created_after)
    with catalog.read() as conn:
        before = int(conn.execute(select(func.count()).select_from(live)).scalar_one())
    total, first = before, True
    while True:
        with catalog.write() as conn:
            bases = select(c.c.base_id).where(needs, (users | seed) if first else users).distinct()
            conn.execute(insert(live).from_select(["id"], bases))
            now = int(conn.execute(select(func.count()).select_from(live)).scalar_one())
        if now == total and not first:
            return now - before
        total, first = now, False


def _unreferenced() -> Any:
    return ~exists().where(s.gc_live.c.id == s.chunks.c.id)


def _on_fast_tier() -> Any:
    """Chunks in a pack still waiting on a fast tier: gc leaves them (and their pack) alone
    until the drain has made the pack ``live``; it cannot read or delete them from here."""
    return exists().where(s.packs.c.id == s.chunks.c.pack_id, s.packs.c.state != "live")


def revive(catalog: Catalog) -> int:
    """Condemned chunks that are referenced again (undelete, a commit) become live."""
    with catalog.write() as conn:
        result = conn.execute(update(s.chunks).where(
            s.chunks.c.state == "condemned", ~_unreferenced()
        ).values(state="live", condemned_at=None))
        return int(result.rowcount)


def condemn(catalog: Catalog, *, created_before: float, now: float, dry_run: bool) -> tuple[int, int]:
    """Condemn live chunks nothing references (made before ``created_before``).

    Returns (chunks, stored bytes). Chunks written by commits still in flight
    after the mark began are never condemned; older ones that a commit in
    flight needs are revived when it publishes, or written again.
    """
    where = and_(s.chunks.c.state == "live", s.chunks.c.created_at < created_before, _unreferenced(),
                 ~_on_fast_tier())
    with catalog.write() as conn:
        count, size = conn.execute(
            select(func.count(), func.coalesce(func.sum(s.chunks.c.stored_len), 0)).where(where)
        ).one()
        if not dry_run:
            conn.execute(update(s.chunks).where(where).values(state="condemned", condemned_at=now))
    return int(count), int(size)


def sweep(catalog: Catalog, *, cutoff: float, dry_run: bool,
          condemned_before: float | None = None, run_id: int | None = None) -> tuple[int, list[DeadPack]]:
    """Remove chunks condemned before ``cutoff`` and still unreferenced, then packs left empty.

    One transaction, which also counts them in gc run ``run_id``'s row; returns (chunks
    removed, packs whose objects to delete). A dry run removes nothing and, given
    ``condemned_before`` (a grace of 0: what the run would condemn it would also sweep), counts
    live unreferenced chunks made before it as doomed.
    """
    c, p = s.chunks, s.packs
    doomed = _doomed(cutoff, condemned_before if dry_run else None)
    empty = and_(~exists().where(c.c.pack_id == p.c.id), p.c.created_at <= cutoff, p.c.state == "live")
    with catalog.write() as conn:
        if dry_run:
            chunks = int(conn.execute(select(func.count()).where(doomed)).scalar_one())
            survivors = select(c.c.id).where(c.c.pack_id == p.c.id, ~doomed)
            rows = conn.execute(select(p.c.id, p.c.key, p.c.size).where(
                ~exists(survivors), p.c.created_at <= cutoff, p.c.state == "live"
            )).all()
            found = layouts_in(conn, [row[0] for row in rows])
            return chunks, [DeadPack(*row, found.get(row[0])) for row in rows]
        chunks = int(conn.execute(delete(c).where(doomed)).rowcount)
        if chunks:  # a tree node goes with its chunk (a version needing it keeps both)
            n, m = s.tree_nodes, s.rekey_map
            conn.execute(delete(n).where(~exists().where(c.c.id == n.c.id)))
            # and a re-key map row with the chunk it names (a copy maps only chunks of versions
            # it published: live, never swept by this statement; one it maps after is dropped
            # by the next sweep, and a lookup skips it meanwhile)
            conn.execute(delete(m).where(~exists().where(c.c.id == m.c.chunk_id)))
        rows = conn.execute(select(p.c.id, p.c.key, p.c.size).where(empty)).all()
        ids = [row[0] for row in rows]
        found = layouts_in(conn, ids)
        for batch in batches(ids):
            conn.execute(delete(s.shards).where(s.shards.c.pack_id.in_(batch)))
            conn.execute(delete(p).where(p.c.id.in_(batch)))
        count_in_run(conn, run_id, chunks_swept=chunks, packs_deleted=len(ids))
    return chunks, [DeadPack(*row, found.get(row[0])) for row in rows]


def _doomed(cutoff: float, condemned_before: float | None) -> Any:
    """Chunks a sweep at ``cutoff`` removes; with ``condemned_before`` (a dry run of grace 0),
    also the live unreferenced ones made before it, which the run would condemn first."""
    c = s.chunks
    doomed = and_(c.c.state == "condemned", c.c.condemned_at <= cutoff, _unreferenced())
    if condemned_before is not None:
        doomed = or_(doomed, and_(c.c.state == "live", c.c.created_at < condemned_before,
                                  _unreferenced(), ~_on_fast_tier()))
    return doomed


def would_repack(catalog: Catalog, *, cutoff: float, condemned_before: float,
                 max_live_fraction: float) -> list[DeadPack]:
    """The packs a gc of grace 0 would repack after its sweep (a dry run's estimate): those
    whose surviving chunks fill at most ``max_live_fraction`` of them, none condemned or lost.
    The same rule as :func:`repack_candidates`, applied to what the sweep would leave."""
    c, p = s.chunks, s.packs
    survives = and_(c.c.pack_id == p.c.id, ~_doomed(cutoff, condemned_before))
    live = select(func.coalesce(func.sum(c.c.stored_len + _CHUNK_OVERHEAD), 0)).where(
        survives).scalar_subquery()
    with catalog.read() as conn:
        rows = conn.execute(select(p.c.id, p.c.key, p.c.size).where(
            p.c.state == "live", exists().where(survives),
            ~exists().where(survives, c.c.state.in_(("condemned", "lost"))),
            live <= p.c.size * max_live_fraction,
        )).all()
        found = layouts_in(conn, [row[0] for row in rows])
    return [DeadPack(*row, found.get(row[0])) for row in rows]


def condemned_bytes(catalog: Catalog) -> int:
    """Stored bytes of chunks condemned and still stored (a later gc frees them)."""
    with catalog.read() as conn:
        return int(conn.execute(select(func.coalesce(func.sum(s.chunks.c.stored_len), 0))
                                .where(s.chunks.c.state == "condemned")).scalar_one())


def known_shard_keys(catalog: Catalog) -> set[tuple[int, str]]:
    """(location id, object name) of every shard the catalog knows (packs are few: ~64 MiB each)."""
    with catalog.read() as conn:
        return {(row[0], row[1]) for row in conn.execute(
            select(s.shards.c.location_id, s.shards.c.key))}


def known_version_ids(catalog: Catalog) -> set[str]:
    """Ids of every version row, visible or deleted."""
    with catalog.read() as conn:
        return set(conn.execute(select(s.versions.c.id)).scalars())


def republished(catalog: Catalog, version_ids: Collection[str]) -> set[str]:
    """Which of these purged ids are a version again, or named by a lease: a copy from another
    store publishes the same id (the same manifest bytes), and its manifest object is its own."""
    found: set[str] = set()
    with catalog.read() as conn:
        for batch in batches(list(version_ids)):
            for column in (s.versions.c.id, s.leases.c.version_id):
                found.update(conn.execute(select(column).where(column.in_(batch))).scalars())
    return found


def known_pack_ids(catalog: Catalog) -> set[str]:
    """Ids of every pack the catalog records."""
    with catalog.read() as conn:
        return set(conn.execute(select(s.packs.c.id)).scalars())


def tombstoned_ids(catalog: Catalog) -> set[str]:
    """Ids of versions whose manifest objects may be deleted (purged, or never published)."""
    with catalog.read() as conn:
        return set(conn.execute(select(s.tombstones.c.version_id)).scalars())


def known_manifests(catalog: Catalog, version_ids: Collection[str]) -> set[str]:
    """Which of these ids the catalog knows: a version row, a tombstone, or the version a commit
    holding a lease (in flight, or killed and not yet reaped by gc) was about to publish."""
    found: set[str] = set()
    with catalog.read() as conn:
        for batch in batches(list(version_ids)):
            for column in (s.versions.c.id, s.tombstones.c.version_id, s.leases.c.version_id):
                found.update(conn.execute(select(column).where(column.in_(batch))).scalars())
    return found


def repack_candidates(catalog: Catalog, *, max_live_fraction: float) -> list[tuple[str, str, int]]:
    """Packs whose live chunks fill at most ``max_live_fraction`` of them, with nothing condemned
    or lost. A chunk counts with its entry header and footer entry, so a pack of small chunks
    that is all live is never a candidate (it would be repacked again on every run)."""
    c, p = s.chunks, s.packs
    live = select(func.coalesce(func.sum(c.c.stored_len + _CHUNK_OVERHEAD), 0)).where(
        c.c.pack_id == p.c.id
    ).scalar_subquery()
    condemned = exists().where(c.c.pack_id == p.c.id, c.c.state.in_(("condemned", "lost")))
    with catalog.read() as conn:
        rows = conn.execute(select(p.c.id, p.c.key, p.c.size).where(
            p.c.state == "live", ~condemned, live <= p.c.size * max_live_fraction,
            exists().where(c.c.pack_id == p.c.id),
        )).all()
    return [(row[0], row[1], int(row[2])) for row in rows]


def live_chunks_of(catalog: Catalog, pack_id: str) -> list[Any]:
    """The chunk rows still stored in a pack."""
    with catalog.read() as conn:
        return list(conn.execute(select(s.chunks).where(s.chunks.c.pack_id == pack_id)
                                 .order_by(s.chunks.c.offset)))


def relocate(catalog: Catalog, record: StoredPack, old_pack_id: str) -> None:
    """Point the chunk rows of ``old_pack_id`` at their copies in the new pack ``record``."""
    moves = [
        {"cid": e.chunk_id.hex(), "old": old_pack_id, "new": record.id, "off": e.offset}
        for e in record.entries
    ]
    with catalog.write() as conn:
        insert_pack(conn, record.layout, len(record.entries), time.time())
        conn.execute(
            update(s.chunks)
            .where(s.chunks.c.id == bindparam("cid"), s.chunks.c.pack_id == bindparam("old"))
            .values(pack_id=bindparam("new"), offset=bindparam("off")),
            moves,
        )
