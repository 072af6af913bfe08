"""A copy between stores, executed: each planned version published at the destination.

Versions are published one at a time, ancestors first, each as a commit is (docs/ARCHITECTURE.md,
Copying between stores): a lease on the destination naming the version, then its missing
chunks while its manifest object is put on every active location (on a thread), then, once
its chunks are recorded and the manifest stored, ONE catalog transaction that
re-checks every chunk and node it references, inserts the version row (the source's step,
metadata, metrics, message, creation time and manifest bytes) and its tags, and ends the
lease. A chunk the destination's gc swept meanwhile is sent again and the publish retried.
The source holds a lease for the whole copy (unless it is read-only), so its gc keeps what
the copy writes nowhere and reads everywhere.

The chunks of all versions flow through one pipeline (:mod:`.copypipe`): a version's lease
begins before its first chunk is given to the packer, its manifest uploads meanwhile, and
it is published as soon as every pack holding its chunks is recorded, while the chunks of
the versions after it are read, packed and uploaded -- so neither the link nor the packer
waits for a publish, and at any time the versions whose chunks are in flight hold a lease
each.

A copy killed at any point leaves what a killed commit leaves: recorded packs no version
references (the next copy finds their chunks held and does not send them again; gc reclaims
them otherwise), and leases gc reaps as crashed, tombstoning the unpublished manifests.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from casckpt.catalog import MissingChunksError, treechanges
from casckpt.catalog import history as history_sql
from casckpt.catalog import nodes as node_sql
from casckpt.catalog.leases import begin_lease, release_lease
from casckpt.catalog.rows import version as version_of
from casckpt.engine.context import EngineContext
from casckpt.engine.copying.copychunks import Sent
from casckpt.engine.copying.copypipe import Batch, Pipeline, plan_batches
from casckpt.engine.copying.copyplan import CopyPlan, VersionPlan
from casckpt.engine.read.degraded import summary
from casckpt.engine.versions import records
from casckpt.engine.write.commitchunks import Progress
from casckpt.errors import CatalogError, RunExistsError
from casckpt.format import objectnames
from casckpt.format.merkle import compress_node
from casckpt.storage.erasure import Redundancy
from casckpt.types import CopiedVersion, ProgressCallback

__all__ = ["Outcome", "execute", "fork_run", "set_tags", "warn_down"]

log = logging.getLogger(__name__)

_PUBLISH_ATTEMPTS = 3


@dataclass(slots=True)
class Outcome:
    """What :func:`execute` did."""

    versions: list[CopiedVersion] = field(default_factory=list)
    sent: Sent = field(default_factory=Sent)
    tags: list[str] = field(default_factory=list)
    down: set[str] = field(default_factory=set)  # destination locations found unreachable


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
        _Copy(source, dest, out, bar).run(plan.versions)
    finally:
        if lease is not None:
            release_lease(source.catalog, lease, "copy (source side)")
    if out.sent.degraded:
        _warn_degraded(out)
    warn_down(out.down)
    return out


def _warn_degraded(out: Outcome) -> None:
    """One WARNING for a copy some of whose packs are below their redundancy (as a degraded
    commit logs one), naming the locations that refused shards and what brings it back."""
    found = out.sent.degraded
    refused = sorted({name for s in found for name in s.refused})
    todo = (f"location(s) {', '.join(refused)} refused shards: run `casckpt repair` on the destination "
            "once they are back, or mark them failed (`casckpt location fail`), add others "
            "(`casckpt location add`) and repair" if refused else
            "add a location in another failure domain there (`casckpt location add`), then `casckpt repair`")
    log.warning("copy: %d pack(s) stored at the destination are below their redundancy (%s). The "
                "copied versions are published and readable; %s", len(found), summary(found), todo)


@dataclass(slots=True)
class _InFlight:
    """A version of the copy not published yet: its destination lease (None: the destination
    shows it already), its manifest upload, the chunks it sent (``ids``, then ``resent`` more
    after the destination's gc swept them), their raw bytes (``bytes``; nodes included) and
    its tensor data's raw and stored bytes (``raw``, ``stored``)."""

    version: VersionPlan
    lease: str | None
    redundancy: Redundancy | None = None
    manifest: Future[int] | None = None
    batches: list[Batch] = field(default_factory=list)
    ids: list[bytes] = field(default_factory=list)
    resent: int = 0
    bytes: int = 0
    raw: int = 0
    stored: int = 0
    fed: bool = False  # every batch given to the pipeline
    checked: int = 0  # ids[:checked] are recorded (each id is looked at once, not per batch)


def _sending(flight: _InFlight) -> Redundancy:
    """The redundancy ``flight`` sends its chunks with (a version the destination shows already
    has none: it sends nothing)."""
    if flight.redundancy is None:
        raise CatalogError(f"a copy tried to send chunks of {flight.version.row.run}@"
                           f"{flight.version.row.step}, which the destination holds; copy again")
    return flight.redundancy


class _Copy:
    """The versions of a copy through one :class:`Pipeline`, published in order, each as soon
    as every chunk it sent is recorded at the destination."""

    def __init__(self, source: EngineContext, dest: EngineContext, out: Outcome, bar: Progress) -> None:
        self.source, self.dest, self.out, self.bar = source, dest, out, bar
        self.queue: deque[_InFlight] = deque()

    def run(self, versions: Sequence[VersionPlan]) -> None:
        todo = [self._prepare(v) for v in versions]
        pipe = Pipeline(self.source, self.dest, [b for v in todo for b in v.batches])
        manifests = ThreadPoolExecutor(1, thread_name_prefix="casckpt-copy-manifest")
        try:
            for version in todo:
                self._feed(pipe, manifests, version)
            pipe.finish(self.out.sent)
            self._publish_ready(pipe)
            if self.queue:  # every chunk recorded: nothing can be left waiting
                raise CatalogError("a copy finished with versions unpublished; copy again")
        except BaseException:
            pipe.abort()
            for waiting in self.queue:
                if waiting.lease is not None:
                    release_lease(self.dest.catalog, waiting.lease,
                                  f"copy of {waiting.version.row.run}@{waiting.version.row.step}")
            raise
        finally:
            manifests.shutdown(cancel_futures=True)

    def _prepare(self, version: VersionPlan) -> _InFlight:
        """What ``version`` sends, in batches (no lease yet: nothing is written here). A chunk
        found held here and swept by the destination's gc before the publish is sent then."""
        if version.present:
            return _InFlight(version, None, fed=True)
        redundancy = self.dest.packs.placement.redundancy_for(version.row.run)
        self.dest.packs.placement.check_writable(redundancy)
        held = {bytes.fromhex(h) for h in self.dest.catalog.find_chunks([c.hex() for c in version.send])}
        missing = [c for c in version.send if c not in held]
        batches = plan_batches(self.source, self.dest, version, missing)
        return _InFlight(version, None, redundancy, batches=batches)

    def _feed(self, pipe: Pipeline, manifests: ThreadPoolExecutor, flight: _InFlight) -> None:
        """Take ``flight``'s lease (before any of its chunks is written), start its manifest
        upload, give its batches to ``pipe`` and publish whatever is ready meanwhile."""
        self.queue.append(flight)
        if flight.fed:
            self._publish_ready(pipe)
            return
        row = flight.version.row
        flight.lease = begin_lease(self.dest.catalog, row.id)
        flight.manifest = manifests.submit(self.dest.locations.put_everywhere,
                                           objectnames.manifest_name(row.id), flight.version.manifest)
        redundancy = _sending(flight)
        for expected in flight.batches:
            batch, chunks = pipe.next_batch()
            if batch is not expected:  # the pipeline reads batches in the order they were planned
                raise CatalogError("a copy's batches came back out of order; copy again")
            written = pipe.pack(batch, chunks, redundancy)
            del chunks  # packed: not held while the next reads run (the read-ahead's bound)
            flight.ids += batch.ids
            flight.bytes += sum(batch.sizes.values())
            flight.raw += written.raw_bytes
            flight.stored += written.stored_bytes
            self.out.sent.add(written, len(batch.ids))
            self.bar.advance(sum(batch.sizes.values()))
            self._publish_ready(pipe)
        flight.fed = True
        self._publish_ready(pipe)

    def _publish_ready(self, pipe: Pipeline) -> None:
        """Publish the versions at the head of the queue whose chunks are all recorded."""
        while self.queue and self.queue[0].fed:
            head = self.queue[0]
            head.checked = pipe.recorded_upto(head.ids, head.checked)
            if head.checked < len(head.ids):
                return
            self._publish_one(pipe, self.queue.popleft())

    def _publish_one(self, pipe: Pipeline, flight: _InFlight) -> None:
        version, row = flight.version, flight.version.row
        published = False  # by this copy (not: the destination showed it, or another copy won)
        if flight.lease is not None:
            recorded: list[str] = []  # tags new there: recorded before they are visible (see set_tags)
            try:
                fork_run(self.dest, row.run, history_sql.fork_point(self.source.catalog, row.run))
                if flight.manifest is not None:
                    flight.manifest.result()
                for name in version.tags:
                    if self.dest.catalog.tag_target(name) is None:
                        records.record_tag(self.dest.locations, self.dest.catalog, name, row.id)
                        recorded.append(name)
                published = self._publish_retrying(pipe, flight, flight.lease)
            except BaseException:
                release_lease(self.dest.catalog, flight.lease, f"copy of {row.run}@{row.step}")
                _restore_records(self.dest, recorded)
                raise
        self.out.tags += set_tags(self.dest, row.id, version.tags, published=published, down=self.out.down)
        self.out.versions.append(CopiedVersion(
            row.id, row.id, row.run, row.step, version.asked, published, len(flight.ids) + flight.resent,
            flight.bytes))

    def _publish_retrying(self, pipe: Pipeline, flight: _InFlight, lease: str) -> bool:
        """Publish ``flight``, sending again through ``pipe`` what the destination's gc swept of
        the chunks it held (not covered by the lease: they predate it); False: another copy
        published it first (what this one sent for it stays counted: it was stored)."""
        version, sent = flight.version, self.out.sent
        redundancy = _sending(flight)
        for _ in range(_PUBLISH_ATTEMPTS):
            try:
                return _publish(self.dest, version, flight.raw, flight.stored, lease,
                                tree_changes_of(self.source, version))
            except MissingChunksError as exc:  # the destination's gc swept chunks it held
                lost = [bytes.fromhex(h) for h in exc.missing]
                self.dest.cache.discard(lost)
                raw, stored = sent.raw_bytes, sent.stored_bytes
                flight.bytes += pipe.resend(version, lost, redundancy, sent, self.bar)
                flight.raw += sent.raw_bytes - raw
                flight.stored += sent.stored_bytes - stored
                flight.resent += len(lost)
        row = version.row
        raise CatalogError(
            f"could not publish version {row.id[:12]} ({row.run}@{row.step}) at the destination: its "
            "chunks kept disappearing (is a gc with --grace 0 running there?); copy again")


def _restore_records(dest: EngineContext, names: Sequence[str]) -> None:
    """After a failed publish: the record of each tag in ``names`` (written before the publish,
    found absent from the catalog then) written again as the catalog has the tag now, should
    it have been set there meanwhile, else removed (a record of a version never published
    now, which a rebuild would follow once a later copy publishes that version without the
    tag). Best effort: the publish's error is what is raised."""
    for name in names:
        try:
            target = dest.catalog.tag_target(name)
            if target is not None:
                records.record_tag(dest.locations, dest.catalog, name, target)
            elif not records.drop_tag(dest.locations, dest.catalog, name):
                raise CatalogError(f"a location kept the record of tag {name}")
        except CatalogError as exc:  # the catalog is down too, or a location kept the record
            log.warning("copy: could not restore or remove the record of tag %s after a failed "
                        "publish (%s): a catalog rebuild may follow it; `casckpt check` reports a "
                        "record that disagrees with the catalog", name, exc)


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


def tree_changes_of(source: EngineContext, version: VersionPlan) -> list[treechanges.Change] | None:
    """The ``tree_changes`` rows the source records for ``version`` against its parent, which
    the destination records with it as a commit does (None: the source has none against its
    parent: the destination computes them from the trees when asked, as the source would)."""
    if version.root is None:
        return None
    with source.catalog.read() as conn:
        found = treechanges.recorded(conn, version.row.id)
    return found[1] if found is not None and found[0] == version.row.parent_id else None


def _publish(dest: EngineContext, version: VersionPlan, raw: int, stored: int, lease: str,
             changes: list[treechanges.Change] | None) -> bool:
    """ONE transaction: the version row, its new tree node rows, ``tree_changes`` rows and
    tags; ``lease`` ends. False: another copy published the version first (this one wrote
    nothing of it here)."""
    row = version.row
    value = version_of(row)
    have = node_sql.tree_node_ids(dest.catalog, [i.hex() for i in version.nodes])
    nodes = [{"id": i.hex(), "body": compress_node(version.nodes[i])}  # read: only the rows it lacks
             for i in version.nodes if i.hex() not in have]
    return dest.catalog.add_version({
        "id": row.id, "step": row.step, "parent_id": row.parent_id, "state": "visible",
        "created_at": row.created_at, "committed_at": time.time(), "logical_bytes": row.logical_bytes,
        "new_bytes": raw, "stored_bytes": stored, "duration_s": row.duration_s, "stall_s": row.stall_s,
        "meta": value.metadata, "metrics": value.metrics, "message": row.message,
        "manifest": version.manifest, "durability": "durable",
        "tree_root": version.root.hex() if version.root is not None else None,
    }, row.run, [], [], version.tags, [c.hex() for c in version.ids], nodes, lease=lease,
        tree_changes=changes)


def set_tags(dest: EngineContext, version_id: str, tags: Sequence[str], *, published: bool,
             down: set[str] | None = None) -> list[str]:
    """The source's ``tags`` on a copied version set at the destination on ``version_id`` (moved
    there if they named another version; publishing set them already); returns the ones
    that changed, whose record objects are written (again). A tag new at the destination
    had its record written before the publish too, so a copy killed right after publishing
    leaves it in place (a record of a version never published is one no check expects and a
    catalog rebuild skips). The record of a tag already in place is written again on each
    location that lacks it or where it names another version (a record a copy killed between
    the publish and the record left stale, or one a location lost: ``records.tag_lacking``,
    one read per location). ``down``: the locations this copy found unreachable (not read
    or written again; those found now are added, and the copy warns once for them)."""
    down = set() if down is None else down
    changed = list(tags) if published else []
    for name in tags:
        if not published and dest.catalog.tag_target(name) != version_id:
            dest.catalog.set_tag(name, version_id)
            changed.append(name)
    for name in tags:
        targets = (dest.locations.active() if name in changed else
                   records.tag_lacking(dest.locations, dest.catalog, name, version_id, down))
        if targets:
            records.record_tag_on(targets, dest.catalog, name, version_id, down)
    return changed


def warn_down(down: set[str]) -> None:
    """One WARNING for the destination locations a copy could not read or write tag records on."""
    if down:
        log.warning("copy: destination location(s) %s could not be read or written: the records of the "
                    "tags this copy carries may be missing or stale there; `casckpt check` reports "
                    "them and `casckpt repair` writes them again once the locations are back",
                    ", ".join(sorted(down)))
