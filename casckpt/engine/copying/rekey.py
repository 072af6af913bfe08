"""Copies across chunk-id keys: each version committed again under the destination's keys.

Between stores whose chunk ids are keyed differently (one encrypted and one not, or two
data keys) the same bytes have different ids, so the manifest -- which names chunk ids and
tree nodes -- cannot travel as it is. Each version is read from the source (verified,
deltas decoded; all but the extents the destination's re-key map names,
:mod:`casckpt.engine.copying.rekeymap`) and committed at the destination through its own
commit pipeline (:mod:`casckpt.engine.write.commit`: snapshot, dedup against the
destination's keyed ids, delta coding, sealing, packing, one publishing transaction), with
the source's run, step, creation time, metadata, metrics, message and tags, and as its
parent the destination's copy of the source's parent. Only chunks the destination lacks
are written; a source chunk id says nothing about the destination's, so what the map
cannot name is read from the source. The version id then differs: the report maps source id -> destination id.

A version counts as held by the destination when the destination has a version at its run
and step created at the same instant (a copy again finds it and sends nothing); another
version there is a conflict. Versions many ranks saved (a ``world``) are refused: committed
again from one process they would change their layout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from casckpt.catalog import Catalog
from casckpt.catalog import history as history_sql
from casckpt.catalog import retention as retention_sql
from casckpt.catalog.leases import begin_lease, release_lease
from casckpt.catalog.rows import VersionRow
from casckpt.catalog.rows import version as version_of
from casckpt.engine.context import EngineContext
from casckpt.engine.copying import rekeymap
from casckpt.engine.copying.copy import Outcome, fork_run, set_tags, warn_down
from casckpt.engine.copying.copyplan import chain, movable_tags, refuse_foreign_run
from casckpt.engine.read.degraded import Shortfall
from casckpt.engine.read.restore import materialize
from casckpt.engine.versions.refs import load_manifest
from casckpt.engine.write import commit as commit_engine
from casckpt.errors import CatalogError, CopyConflictError, CopyUnsupportedError
from casckpt.format.manifest import Manifest, decode_manifest
from casckpt.types import CopiedVersion, ProgressCallback

__all__ = ["Rekeyed", "execute", "plan"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Rekeyed:
    """One version of a copy across keys: its source row, whether it was asked for, the
    source's tags on it the copy sets there and those it leaves (``copyplan.movable_tags``), and
    its id at the destination when the destination holds it."""

    row: VersionRow
    asked: bool
    tags: tuple[str, ...]
    held: str | None
    kept_tags: tuple[str, ...] = ()


def held_at(dest: Catalog, row: VersionRow) -> str | None:
    """The id of the destination's copy of ``row``: its version at the same run and step,
    created at the same instant (None: it has none)."""
    there = dest.at_step(row.run, row.step)
    return there.id if there is not None and there.created_at == row.created_at else None


def _deleted_there(dest: Catalog, row: VersionRow) -> bool:
    """Whether ``dest`` holds a version at ``row``'s run and step deleted (its retention's
    choice, or a user's: a copy does not undo it)."""
    return bool(retention_sql.find_deleted(dest, run=row.run, step=row.step, limit=1))


def plan(source: Catalog, dest: Catalog, asked: Sequence[VersionRow], *,
         lineage: bool = True) -> list[Rekeyed]:
    """The versions a copy of ``asked`` across keys commits, ancestors first (see module).

    Raises:
        CopyConflictError: the destination holds another version at one's run and step.
        CopyUnsupportedError: one was saved by many ranks.
    """
    out = []
    checked: set[str] = set()

    def reached(row: VersionRow) -> bool:  # shown there, or deleted there (an ancestor: ends the line)
        return held_at(dest, row) is not None or _deleted_there(dest, row)

    for row, was_asked in chain(source, dest, asked, reached, lineage=lineage):
        held = held_at(dest, row)
        if held is None and _deleted_there(dest, row):
            if not was_asked:
                continue
            raise CopyConflictError(  # committing it again would give the deleted row's id back
                f"the destination holds {row.run}@{row.step} deleted: undelete it there (`casckpt "
                f"undelete {row.run}@{row.step}`), or let its gc purge it, then copy again")
        there = dest.at_step(row.run, row.step)
        if held is None:
            refuse_foreign_run(source, dest, row.run, checked, keyed_alike=False)
        if held is None and there is not None:
            raise CopyConflictError(
                f"the destination already has another version at {row.run}@{row.step} ({there.id[:12]}, "
                "created at another time): the two stores' runs diverged. Delete that version from the "
                "destination (`casckpt delete`, then `casckpt gc`), or copy into a store without it")
        if held is None and decode_manifest(source.manifest(row.id), row.id).world is not None:
            raise CopyUnsupportedError(
                f"version {row.id[:12]} ({row.run}@{row.step}) was saved by many ranks; a copy between "
                "stores keyed differently commits each version again from one process, which would "
                "change its layout. Restore it and commit it to the destination yourself, or copy "
                "into a store with the same keys")
        tags, kept = movable_tags(source, dest, row.id)
        out.append(Rekeyed(row, was_asked, tags, held, kept))
    return out


def execute(source: EngineContext, dest: EngineContext, versions: Sequence[Rekeyed],
            progress: ProgressCallback | None = None, *, source_lease: bool = True) -> Outcome:
    """Commit every version of ``versions`` the destination lacks there, ancestors first.

    Raises:
        MissingDataError, CorruptChunkError: the source cannot read a version whole.
        And what a commit raises at the destination.
    """
    out = Outcome()
    ids: dict[str, str] = {}
    lease = begin_lease(source.catalog) if source_lease else None
    try:
        for item in versions:
            row = item.row
            if item.held is not None:
                ids[row.id] = item.held
                out.tags += set_tags(dest, item.held, item.tags, published=False, down=out.down)
                out.versions.append(CopiedVersion(row.id, item.held, row.run, row.step, item.asked, False))
                continue
            new_id, chunks, raw, stored = _recommit(source, dest, item, ids, progress, out.sent.degraded)
            out.sent.chunks += chunks
            out.sent.raw_bytes += raw
            out.sent.stored_bytes += stored
            ids[row.id] = new_id
            out.tags += item.tags  # the commit set them (and mirrored them)
            out.versions.append(CopiedVersion(row.id, new_id, row.run, row.step, item.asked, True,
                                              chunks, raw))
    finally:
        if lease is not None:
            release_lease(source.catalog, lease, "copy (source side)")
    warn_down(out.down)
    return out


def _mapped(source: EngineContext, dest: EngineContext, version_id: str | None,
            ids: dict[str, str]) -> str | None:
    """The destination's id of the source's version ``version_id`` (None: none, or the source
    no longer shows it)."""
    if version_id is None:
        return None
    if version_id in ids:
        return ids[version_id]
    row = source.catalog.version(version_id)
    return held_at(dest.catalog, row) if row is not None else None


def _recommit(source: EngineContext, dest: EngineContext, item: Rekeyed, ids: dict[str, str],
              progress: ProgressCallback | None, degraded: list[Shortfall]) -> tuple[str, int, int, int]:
    """Read one version from the source (all but the extents the re-key map names at the
    destination) and commit it at the destination; returns its id there, the chunks
    written, their raw bytes and the bytes stored. The packs it stored below their
    redundancy are added to ``degraded`` (the commit warns of them, as any commit does)."""
    row, started = item.row, time.monotonic()
    manifest = load_manifest(source.catalog, row)
    value = version_of(row)
    req = commit_engine.make_request(row.run, row.step, value.metadata, value.metrics, row.message,
                                     item.tags)
    commit_engine.refuse_existing(dest, req)
    parent = _mapped(source, dest, row.parent_id, ids)
    fork_run(dest, row.run, _mapped(source, dest, history_sql.fork_point(source.catalog, row.run), ids))
    redundancy = dest.packs.placement.redundancy_for(row.run)
    dest.packs.placement.check_writable(redundancy)
    snap, match = _snapshot(source, dest, manifest, req, row.created_at, parent, progress)
    lease = begin_lease(dest.catalog, snap.version_id)
    try:
        version = commit_engine.finish(dest, req, snap, redundancy, started, lease, progress)
    except BaseException as exc:
        release_lease(dest.catalog, lease, f"copy of {row.run}@{row.step}")
        if isinstance(exc, CatalogError) and match.mapping.skip:
            raise CatalogError(
                f"could not copy {row.run}@{row.step}: the destination's gc swept chunks the re-key "
                "map named while the copy ran (is a gc with --grace 0 running there?), and their "
                "bytes were not read from the source; copy again (it reads them from the source)") from exc
        raise
    degraded += snap.degraded
    rekeymap.remember(source, dest, manifest, match, snap.manifest)
    return version.id, len(snap.new_ids), version.new_bytes, version.stored_bytes


def _snapshot(source: EngineContext, dest: EngineContext, manifest: Manifest,
              req: commit_engine.CommitRequest, created: float, parent: str | None,
              progress: ProgressCallback | None) -> tuple[commit_engine.Snapshot, rekeymap.ExtentMatch]:
    """The destination's snapshot of the source's version: the extents the map names are not
    read (their ids come from the map); should the destination plan one of them otherwise,
    the version is read whole."""
    mapping = rekeymap.plan(source, dest, manifest)
    while True:
        state = materialize(source, manifest, map_location="cpu", progress=progress, skip=mapping.skip)
        match = rekeymap.ExtentMatch(manifest, mapping, dest.config.chunk_size)
        try:
            return commit_engine.snapshot(dest, state, req, created, parent=parent, progress=progress,
                                          mapped=match), match
        except rekeymap.Unmapped:
            if mapping is rekeymap.NOTHING:
                raise
            log.info("copy of %s@%s: the destination lays out a mapped extent otherwise; reading "
                     "the version whole", req.run, req.step)
            mapping = rekeymap.NOTHING
