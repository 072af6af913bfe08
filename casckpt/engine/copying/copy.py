"""A copy between stores, executed: each planned version published at the destination.

Versions go one at a time, ancestors first, each as a commit goes (docs/ARCHITECTURE.md,
Copying between stores): a lease on the destination naming the version, then its missing
chunks (:mod:`.copychunks`), then its manifest object on every active location, then ONE
catalog transaction that re-checks every chunk and node it references, inserts the version
row (the source's step, metadata, metrics, message, creation time and manifest bytes) and
its tags, and ends the lease. A chunk the destination's gc swept meanwhile is sent again
and the publish retried. The source holds a lease for the whole copy (unless it is
read-only), so its gc keeps what the copy writes nowhere and reads everywhere.

A copy killed at any point leaves what a killed commit leaves: recorded packs no version
references (the next copy finds their chunks held and does not send them again; gc reclaims
them otherwise), and a lease gc reaps as crashed, tombstoning the unpublished manifest.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from casckpt.catalog import MissingChunksError
from casckpt.catalog import history as history_sql
from casckpt.catalog import nodes as node_sql
from casckpt.catalog.leases import begin_lease, release_lease
from casckpt.catalog.rows import version as version_of
from casckpt.engine.context import EngineContext
from casckpt.engine.copying.copychunks import Sent, send
from casckpt.engine.copying.copyplan import CopyPlan, VersionPlan
from casckpt.engine.versions import records
from casckpt.engine.write.commitchunks import Progress
from casckpt.errors import CatalogError, RunExistsError
from casckpt.format import objectnames
from casckpt.format.merkle import compress_node
from casckpt.types import CopiedVersion, ProgressCallback

__all__ = ["Outcome", "execute", "fork_run", "set_tags"]

_PUBLISH_ATTEMPTS = 3


@dataclass(slots=True)
class Outcome:
    """What :func:`execute` did."""

    versions: list[CopiedVersion] = field(default_factory=list)
    sent: Sent = field(default_factory=Sent)
    tags: list[str] = field(default_factory=list)


def execute(source: EngineContext, dest: EngineContext, plan: CopyPlan,
            progress: ProgressCallback | None = None, *, source_lease: bool = True) -> Outcome:
    """Publish every version of ``plan`` at ``dest`` (see module). ``source_lease``: hold a
    lease on the source (False for a read-only source, which cannot record one).

    Raises:
        MissingDataError, CorruptChunkError: a chunk could not be read whole from the source.
        StorageError, CatalogError: the destination could not store or publish a version
            (versions published before it stay published; a copy again resumes).
    """
    out = Outcome()
    bar = Progress(progress, "copy", plan.send_bytes)
    lease = begin_lease(source.catalog) if source_lease else None
    try:
        for version in plan.versions:
            row = version.row
            chunks = 0 if version.present else _copy_one(source, dest, version, bar, out.sent)
            out.tags += set_tags(dest, row.id, version.tags, published=not version.present)
            out.versions.append(CopiedVersion(
                row.id, row.id, row.run, row.step, version.asked, not version.present, chunks,
                0 if version.present else version.send_bytes))
    finally:
        if lease is not None:
            release_lease(source.catalog, lease, "copy (source side)")
    return out


def _copy_one(source: EngineContext, dest: EngineContext, version: VersionPlan, bar: Progress,
              sent: Sent) -> int:
    """Send one version's missing chunks and publish it; returns the chunks sent."""
    row = version.row
    fork_run(dest, row.run, history_sql.fork_point(source.catalog, row.run))
    redundancy = dest.packs.placement.redundancy_for(row.run)
    dest.packs.placement.check_writable(redundancy)
    lease = begin_lease(dest.catalog, row.id)
    before = (sent.chunks, sent.raw_bytes, sent.stored_bytes)
    try:
        held = {bytes.fromhex(h) for h in dest.catalog.find_chunks([c.hex() for c in version.send])}
        send(source, dest, version, [c for c in version.send if c not in held], redundancy, bar, sent)
        dest.locations.put_everywhere(objectnames.manifest_name(row.id), version.manifest)
        for _ in range(_PUBLISH_ATTEMPTS):
            try:
                _publish(dest, version, sent.raw_bytes - before[1], sent.stored_bytes - before[2], lease)
                return sent.chunks - before[0]
            except MissingChunksError as exc:  # the destination's gc swept chunks it held
                lost = [bytes.fromhex(h) for h in exc.missing]
                dest.cache.discard(lost)
                send(source, dest, version, lost, redundancy, Progress(None, "copy", 0), sent)
        raise CatalogError(
            f"could not publish version {row.id[:12]} ({row.run}@{row.step}) at the destination: its "
            "chunks kept disappearing (is a gc with --grace 0 running there?); copy again")
    except BaseException:
        release_lease(dest.catalog, lease, f"copy of {row.run}@{row.step}")
        raise


def fork_run(dest: EngineContext, run: str, point: str | None) -> None:
    """Fork ``run`` at the destination from ``point`` (the destination's id of the version the
    source forked it from; None: not forked) when the run is new there and the destination
    shows that version (the copy's lineage brought it first)."""
    if point is None or dest.catalog.nth_latest(run, 0) is not None:
        return
    if history_sql.fork_point(dest.catalog, run) is not None or dest.catalog.version(point) is None:
        return
    try:
        history_sql.fork(dest.catalog, run, point)
    except RunExistsError:  # a run of that name (no versions, or created meanwhile): publish into it
        return
    records.record_run(dest.locations, dest.catalog, run)


def _publish(dest: EngineContext, version: VersionPlan, raw: int, stored: int, lease: str) -> None:
    """ONE transaction: the version row, its new tree node rows and tags; ``lease`` ends."""
    row = version.row
    value = version_of(row)
    have = node_sql.tree_node_ids(dest.catalog, [i.hex() for i in version.nodes])
    nodes = [{"id": i.hex(), "body": compress_node(raw_node)}
             for i, raw_node in version.nodes.items() if i.hex() not in have]
    dest.catalog.add_version({
        "id": row.id, "step": row.step, "parent_id": row.parent_id, "state": "visible",
        "created_at": row.created_at, "committed_at": time.time(), "logical_bytes": row.logical_bytes,
        "new_bytes": raw, "stored_bytes": stored, "duration_s": row.duration_s, "stall_s": row.stall_s,
        "meta": value.metadata, "metrics": value.metrics, "message": row.message,
        "manifest": version.manifest, "durability": "durable",
        "tree_root": version.root.hex() if version.root is not None else None,
    }, row.run, [], [], version.tags, [c.hex() for c in version.ids], nodes, lease=lease)


def set_tags(dest: EngineContext, version_id: str, tags: Sequence[str], *, published: bool) -> list[str]:
    """The source's ``tags`` on a copied version set at the destination on ``version_id`` (moved
    there if they named another version; publishing set them already); returns the ones
    that changed."""
    changed = list(tags) if published else []
    for name in tags:
        if not published and dest.catalog.tag_target(name) != version_id:
            dest.catalog.set_tag(name, version_id)
            changed.append(name)
    for name in changed:
        records.record_tag(dest.locations, dest.catalog, name, version_id)
    return changed
