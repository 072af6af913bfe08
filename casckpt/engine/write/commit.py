"""The commit pipeline: snapshot -> chunk -> hash -> dedup -> encode -> pack -> store -> publish.

Everything that can refuse the state (unsupported objects, bad names) runs
before the first byte is written. The version becomes visible in ONE catalog
transaction, after every pack it references is durable; that transaction
re-checks every referenced chunk, and chunks found missing (a stale cache
hint, a chunk GC removed) are written again before retrying.

This module holds the ends of the pipeline (the request, the snapshot, publishing);
the chunks in between (hash, dedup, encode, pack) are :mod:`casckpt.engine.write.commitchunks`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from casckpt import collector
from casckpt.catalog import MissingChunksError
from casckpt.catalog import nodes as node_sql
from casckpt.catalog.deltas import delta_policy_for
from casckpt.catalog.history import fork_point
from casckpt.catalog.leases import begin_lease, release_lease
from casckpt.catalog.treechanges import Change
from casckpt.engine.context import EngineContext
from casckpt.engine.memory.deltabase import candidate_bases
from casckpt.engine.read import trees
from casckpt.engine.read.degraded import Shortfall, summary
from casckpt.engine.versions import records
from casckpt.engine.versions.extents import ExtentSource, PackMemo, pack_limit, plan_extents
from casckpt.engine.versions.validate import (
    check_message,
    check_metadata,
    check_metrics,
    check_name,
    check_step,
    check_tags,
)
from casckpt.engine.write import treeindex
from casckpt.engine.write.commitchunks import (
    NOT_HELD,
    ChunkBytes,
    ChunkWrite,
    Reserve,
    hash_extents,
    known_chunks,
    node_chunks,
    write_chunks,
)
from casckpt.engine.write.commitchunks import owned_copy as _copy  # a global here: tests make it fail
from casckpt.engine.write.encodepolicy import EncodePlan, encode_plan
from casckpt.engine.write.hint import ChangeHint, Counters, fingerprints, reusable, trusted_counters
from casckpt.errors import CasckptError, CatalogError, StorageError, VersionExistsError
from casckpt.format import objectnames
from casckpt.format.manifest import ExtentEntry, Manifest, TensorEntry
from casckpt.format.state import encode_state
from casckpt.format.treeencode import Tree, TreeMemo
from casckpt.format.treemanifest import encode_tree_manifest, headed
from casckpt.storage.erasure import Redundancy
from casckpt.storage.locations import LocationSet
from casckpt.types import ProgressCallback, Version

log = logging.getLogger(__name__)

Mapped = Callable[[Sequence[TensorEntry], Sequence[ExtentSource]], dict[int, ExtentEntry]]
"""What a caller that knows some extents' chunk ids already reuses (:func:`snapshot`'s ``mapped``):
given the planned entries and extents, the extents (by index) whose ids it vouches for."""

_PUBLISH_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class CommitRequest:
    """A validated commit: what to store and under which name."""

    run: str
    step: int
    metadata: dict[str, Any]
    metrics: dict[str, float]
    message: str | None
    tags: tuple[str, ...]


def make_request(
    run: str, step: int, metadata: Mapping[str, Any] | None, metrics: Mapping[str, Any] | None,
    message: str | None, tags: Iterable[str],
) -> CommitRequest:
    """Validate commit arguments (raises before anything is written)."""
    return CommitRequest(
        check_name(run, "run"), check_step(step), check_metadata(metadata),
        check_metrics(metrics), check_message(message), check_tags(tags),
    )


@dataclass(slots=True)
class Snapshot:
    """A commit's state, captured: chunk ids, tree manifest (format 3, the one format written)
    and its nodes, and the bytes of new chunks.

    In a blocking commit ``chunks`` are views of the caller's tensors; in a
    background commit the new chunks are owned copies (``owned`` bytes), so
    the caller may mutate its tensors as soon as the snapshot is taken.
    """

    manifest: Manifest
    version_id: str
    manifest_bytes: bytes
    chunks: dict[bytes, ChunkBytes]
    new_ids: list[bytes]
    tree: Tree
    owned: int = 0
    new_bytes: int = 0
    stored_bytes: int = 0
    foreground: bool = False  # a background commit whose copies did not fit: write it now
    bases: dict[bytes, bytes] = field(default_factory=dict)  # new chunk -> its candidate delta base
    delta: EncodePlan | None = None
    degraded: list[Shortfall] = field(default_factory=list)  # packs written below their redundancy
    stall_s: float | None = None  # a background commit: how long commit() held its caller up
    changes: list[Change] | None = None  # its tree_changes rows (engine/write/treeindex.py); None: unknown

    def wrote(self, written: ChunkWrite) -> None:
        """Count what a :func:`write_chunks` of this snapshot's chunks wrote."""
        self.new_bytes += written.raw_bytes
        self.stored_bytes += written.stored_bytes
        self.degraded.extend(written.degraded)


def snapshot(ctx: EngineContext, state: object, req: CommitRequest, created: float, *,
             parent: str | None, reserve: Reserve | None = None,
             progress: ProgressCallback | None = None,
             pending: Mapping[bytes, ChunkBytes] | None = None, hint: ChangeHint | None = None,
             mapped: Mapped | None = None) -> Snapshot:
    """Encode, hash (in place) and dedup ``state``; build its manifest.

    With ``hint`` (see :mod:`casckpt.engine.write.hint`), the tensors it vouches for are not
    hashed: their chunk ids are the parent's. With ``mapped`` (a copy across keys,
    :mod:`casckpt.engine.copying.rekeymap`), the extents it returns are not hashed either:
    their ids are its, and it answers for the store holding them.

    With ``reserve``, the chunks the store does not hold are copied out of
    the state (after ``reserve(nbytes)`` agrees), so only changed bytes are
    copied and the state is free again when this returns.

    ``pending`` holds the copies of chunks that earlier background commits,
    still in flight, will write: they count as known (written once, not
    copied again); this snapshot keeps a reference to the copy, to write it
    itself should the earlier commit fail.
    """
    last = ctx.memos.take(req.run)  # what the run's last commit in this process derived
    memo = _RunMemo(PackMemo(last.packs if last else None), TreeMemo(last.tree if last else None),
                    last.counters if last and hint is not None else None,
                    last.version_id if last else None)
    try:
        with collector.paused():
            return _snapshot(ctx, state, req, created, parent, reserve, progress, pending, memo, hint, mapped)
    except BaseException:
        # the caller's next hint vouches for its tensors since THIS commit, which made no
        # version: the run's parent is then an older one, whose bytes may differ
        _distrust(memo)
        raise
    finally:
        ctx.memos.keep(req.run, memo)


@dataclass(slots=True)
class _RunMemo:
    packs: PackMemo
    tree: TreeMemo
    counters: Counters | None = None  # the trusted version counters (``trust_versions``)
    version_id: str | None = None  # the version the run's last snapshot in this process made


FAILED_SNAPSHOT = "(a failed snapshot)"
"""``_RunMemo.version_id`` after a snapshot failed: no parent matches it, so the next hint is ignored."""


def distrust_hint(ctx: EngineContext, run: str) -> None:
    """The run's next snapshot in this process ignores its change hint: a commit of the run
    failed (or was refused) before its snapshot, and a hint given after it vouches for
    tensors since that commit, not since the parent's version."""
    memo = ctx.memos.take(run)
    if memo is None:
        memo = _RunMemo(PackMemo(None), TreeMemo(None))
    _distrust(memo)
    ctx.memos.keep(run, memo)


def _distrust(memo: _RunMemo) -> None:
    """Mark ``memo``'s run as having failed a commit: no parent matches it, no counter holds."""
    memo.version_id, memo.counters = FAILED_SNAPSHOT, None


def _snapshot(ctx: EngineContext, state: object, req: CommitRequest, created: float, parent: str | None,
              reserve: Reserve | None, progress: ProgressCallback | None,
              pending: Mapping[bytes, ChunkBytes] | None, memo: _RunMemo,
              hint: ChangeHint | None, mapped: Mapped | None = None) -> Snapshot:
    root, leaves = encode_state(state)
    entries, sources = plan_extents(leaves, pack=pack_limit(ctx.config.chunk_size),
                                    memo=memo.packs, ids=ctx.crypto.chunk_id)
    hint = _trusted_hint(req, parent, memo, hint)
    reuse: dict[int, ExtentEntry] = {}
    held: set[bytes] = set()
    hinted: dict[str, bytes] = {}  # fingerprints of the tensors reused on the hint
    if hint is not None:
        counters = memo.counters if memo.counters is not None and memo.counters.version_id == parent else None
        reuse = reusable(hint, leaves, entries, sources, ctx.config.chunk_size,
                         parent_manifest(ctx, req.run, parent), counters)
        reuse, held = _held(ctx, reuse, pending)
        hinted = fingerprints(ctx.crypto.chunk_id, req.run, req.step, hint, leaves, entries, reuse)
    if mapped is not None:
        vouched = mapped(entries, sources)
        reuse.update(vouched)
        held |= {c for e in vouched.values() for c in e.chunks}  # never new: their bytes are not at hand
    hashed = hash_extents(ctx, sources, progress, pending, reserve, reuse=reuse)
    hashed.known |= held
    extents, chunks = hashed.extents, hashed.chunks
    manifest = Manifest(
        run=req.run, step=req.step, parent=parent,
        created_at=created, root=root, tensors=tuple(entries), extents=tuple(extents),
        metadata=req.metadata, metrics=req.metrics, message=req.message, tags=req.tags, hinted=hinted,
    )
    lookup = [c for c, chunk in chunks.items() if c not in hashed.known and not chunk.owned]
    made: list[Any] = []
    version_id, manifest_bytes, tree = encode_tree_manifest(manifest, memo.tree, ctx.crypto.chunk_id, made)
    changes = treeindex.changes(manifest, memo.tree, memo.version_id, made)
    manifest = headed(manifest, tree)
    for node_id, chunk in node_chunks(tree).items():
        if node_id not in chunks:
            chunks[node_id] = chunk
            lookup.append(node_id)
    memo.counters = trusted_counters(hint, version_id, leaves)
    memo.version_id = version_id
    known = hashed.known | known_chunks(ctx, lookup)  # streamed chunks were looked up while streaming
    new_ids = []
    for cid in chunks:
        if cid in known:
            continue
        if pending is not None and cid in pending:
            chunks[cid] = pending[cid]
            continue
        new_ids.append(cid)
    owned, foreground = _own(ctx, chunks, new_ids, reserve, hashed.reserved)
    delta_on = new_ids and ctx.bases.budget > 0 and delta_policy_for(ctx.catalog, req.run)[0] > 0
    before = parent_manifest(ctx, req.run, parent) if delta_on else None  # bases serve delta coding only
    bases = candidate_bases(before, entries, extents, new_ids) if before is not None else {}
    ctx.bases.remember(req.run, version_id, manifest)
    return Snapshot(manifest, version_id, manifest_bytes, chunks, new_ids, tree, owned,
                    foreground=foreground, bases=bases, changes=changes)


def _trusted_hint(req: CommitRequest, parent: str | None, memo: _RunMemo,
                  hint: ChangeHint | None) -> ChangeHint | None:
    """``hint``, or None where it cannot be trusted: the caller vouches for its tensors since
    the version it committed last; if that is no longer the parent (it failed, or another
    handle or process deleted it), the parent's chunk ids may hold older bytes: every tensor
    is hashed instead."""
    if hint is None or memo.version_id is None or memo.version_id == parent:
        return hint
    last = ("the run's last commit in this process failed before it made a version"
            if memo.version_id == FAILED_SNAPSHOT else
            f"the run's previous version is no longer {memo.version_id[:12]}, the one this "
            "process committed last (it failed, was deleted, or another commit of the run came after it)")
    log.warning("commit %s@%s: ignoring the change hint: %s; every tensor is hashed",
                req.run, req.step, last)
    return None


def _own(ctx: EngineContext, chunks: dict[bytes, ChunkBytes], new_ids: list[bytes],
         reserve: Reserve | None, owned: int) -> tuple[int, bool]:
    """Copy the new chunks the caller may change (a background commit) if ``reserve`` grants
    the memory; returns the bytes owned and whether the write must run in the foreground."""
    if reserve is None:
        return owned, False
    todo = [cid for cid in new_ids if not chunks[cid].owned]  # streamed ones are copies already
    need = sum(chunks[c].end - chunks[c].start for c in todo)
    if not reserve(need):
        return owned, bool(todo)
    for cid, copy in zip(todo, ctx.pool.map(_copy, (chunks[c] for c in todo)), strict=True):
        chunks[cid] = copy
    return owned + need, False


def _held(ctx: EngineContext, reuse: dict[int, ExtentEntry], pending: Mapping[bytes, ChunkBytes] | None
          ) -> tuple[dict[int, ExtentEntry], set[bytes]]:
    """The hinted extents all of whose chunks the store (cache entry, then catalog) or a commit
    in flight holds, and the chunks among them the store holds: a hint never references a
    chunk that is gone (such a tensor is hashed instead)."""
    ids = list(dict.fromkeys(c for e in reuse.values() for c in e.chunks))
    if not ids:
        return {}, set()
    known = known_chunks(ctx, ids)
    have = known | {c for c in ids if pending is not None and c in pending}
    kept = {i: e for i, e in reuse.items() if all(c in have for c in e.chunks)}
    return kept, {c for e in kept.values() for c in e.chunks if c in known}


def parent_manifest(ctx: EngineContext, run: str, parent: str | None) -> Manifest | None:
    """The parent's manifest, to pick delta bases from (None when it cannot be had cheaply)."""
    if parent is None:
        return None
    found = ctx.bases.manifest(run, parent)
    if found is not None:
        return found
    try:
        return trees.decode(ctx, ctx.catalog, ctx.catalog.manifest(parent), parent)
    except CasckptError:  # a parent not visible yet (a pending commit of another process)
        return None


def plan_delta(ctx: EngineContext, run: str, parent: str | None, entries: Sequence[TensorEntry],
               extents: Sequence[ExtentEntry], new_ids: Sequence[bytes]) -> EncodePlan:
    """How a writer that did not snapshot (a rank of a group commit) encodes ``new_ids``, delta
    coded against ``parent``, the run's latest version, where its policy allows."""
    delta_on = new_ids and ctx.bases.budget > 0 and delta_policy_for(ctx.catalog, run)[0] > 0
    before = parent_manifest(ctx, run, parent) if delta_on else None
    return encode_plan(ctx, run, before, entries, extents, new_ids)


def parent_of(ctx: EngineContext, run: str) -> str | None:
    """The parent of ``run``'s next version: its latest, or for a new fork its fork point."""
    parent = ctx.catalog.nth_latest(run, 0)
    return parent.id if parent is not None else fork_point(ctx.catalog, run)


def _publish(ctx: EngineContext, req: CommitRequest, snap: Snapshot, started: float,
             redundancy: Redundancy, progress: ProgressCallback | None, lease: str, *,
             fast: bool = False) -> dict[str, Any]:
    """ONE catalog transaction makes the version visible and ends the commit's ``lease``;
    chunks found gone are rewritten. ``fast``: committed to the fast tier (durability
    ``fast`` until the drain; the catalog also makes a version that needs a pack still on
    some fast tier ``fast``)."""
    row: dict[str, Any] = {
        "id": snap.version_id, "step": req.step, "parent_id": snap.manifest.parent,
        "state": "visible", "created_at": snap.manifest.created_at,
        "logical_bytes": snap.tree.nbytes, "meta": req.metadata,
        "metrics": req.metrics, "message": req.message, "manifest": snap.manifest_bytes,
        "durability": "fast" if fast else "durable", "tree_root": snap.tree.root.hex(),
    }
    for _ in range(_PUBLISH_ATTEMPTS):
        row.update(new_bytes=snap.new_bytes, stored_bytes=snap.stored_bytes,
                   duration_s=time.monotonic() - started, committed_at=time.time())
        # what the caller waited for: a blocking commit (and a save of many ranks) all of it
        row["stall_s"] = row["duration_s"] if snap.stall_s is None else snap.stall_s
        checks, nodes = _checks(ctx, snap)
        try:
            ctx.catalog.add_version(row, req.run, [], [], req.tags, [c.hex() for c in checks], nodes,
                                    lease=lease, tree_changes=snap.changes)
            return row
        except MissingChunksError as exc:
            gone_bases = set(exc.missing) - {cid.hex() for cid in snap.chunks}
            if gone_bases:  # the next commit finds them gone and stores those chunks plainly
                raise CatalogError(
                    f"could not publish version {snap.version_id[:12]}: GC removed delta base(s) "
                    f"{', '.join(sorted(gone_bases)[:3])} while the commit ran (is a GC with --grace 0 "
                    "running?); commit again"
                ) from exc
            snap.wrote(rewrite_lost(ctx, snap.chunks, exc.missing, redundancy, progress, snap.version_id))
    raise CatalogError(
        f"could not publish version {snap.version_id[:12]}: its chunks kept disappearing "
        "(is a GC with --grace 0 running?); retry the commit"
    )


def _checks(ctx: EngineContext, snap: Snapshot) -> tuple[Sequence[bytes], list[dict[str, Any]]]:
    """What publishing re-checks (every chunk and tree node of the version: gc condemns by
    age, so a live node may sit over condemned chunks a reused subtree still needs, and only
    this re-check revives them), and the tree nodes it records (those without a row)."""
    tree = snap.tree
    have = {bytes.fromhex(h) for h in node_sql.tree_node_ids(ctx.catalog, [i.hex() for i in tree.nodes])}
    return list(snap.chunks), trees.node_rows(tree, sorted(i for i in tree.nodes if i not in have))


def rewrite_lost(ctx: EngineContext, chunks: dict[bytes, ChunkBytes], missing: Iterable[str],
                 redundancy: Redundancy, progress: ProgressCallback | None, version_id: str) -> ChunkWrite:
    """Write again the chunks among ``chunks`` that publishing found gone (``missing``, hex):
    GC swept them while the commit (or tree migration) was in flight."""
    gone = set(missing)
    lost = [cid for cid in chunks if cid.hex() in gone]
    ctx.cache.discard(lost)
    _hold_unchanged(ctx, chunks, lost, version_id)
    return write_chunks(ctx, chunks, lost, redundancy, progress, fast=True)


def _hold_unchanged(ctx: EngineContext, chunks: dict[bytes, ChunkBytes], ids: Sequence[bytes],
                    version_id: str) -> None:
    """Before writing chunks again, copy each and check the copy still hashes to its id: the
    copy is what gets written, so bytes changed meanwhile can never go under the old id."""
    for cid in ids:
        chunk = chunks[cid]
        held = chunk if chunk.owned else _copy(chunk)
        if held.view is NOT_HELD or ctx.crypto.chunk_id(held.data()) != cid:
            raise CatalogError(
                f"version {version_id[:12]} reuses a chunk GC removed while the commit was in "
                "flight, and its bytes are no longer at hand (the state changed since, they stayed "
                "on the GPU, or another rank wrote them); commit again"
            )
        chunks[cid] = held


def store_manifest(ctx: EngineContext, snap: Snapshot) -> LocationSet | None:
    """Write the snapshot's manifest object: on every location (returns the set written to),
    or, in a store with a fast tier, on the tier (the drain writes it to the locations once
    the version's packs are there). Only under the commit's lease (see :func:`publish`)."""
    tier = ctx.packs.tier
    if tier is None:
        taken = ctx.locations
        taken.put_everywhere(objectnames.manifest_name(snap.version_id), snap.manifest_bytes)
        return taken
    try:  # a convenience copy: the catalog row holds it too, and the drain falls back on it
        tier.dir.put_manifest(snap.version_id, snap.manifest_bytes)
    except StorageError as exc:
        log.warning("fast tier %s could not keep the manifest of %s (%s); the drain takes it "
                    "from the catalog", tier.dir.root, snap.version_id[:12], exc)
    return None


def manifest_stored(ctx: EngineContext, snap: Snapshot, written: Future[LocationSet | None]) -> None:
    """Wait for the manifest write begun beside the chunks (:func:`store_manifest`), then put
    the manifest on any location activated since that write took its location set (one
    added while the commit wrote its packs), as a manifest written at publish would be."""
    taken = written.result()
    if taken is None:
        return
    now = ctx.locations
    if now is taken:
        return
    had = {loc.id for loc in taken.active()}
    for loc in now.active():
        if loc.id in had:
            continue
        try:
            loc.blobs.put(objectnames.manifest_name(snap.version_id), snap.manifest_bytes)
        except StorageError as exc:  # as put_everywhere: the other locations hold it
            log.warning("could not write the manifest of %s to location %s: %s",
                        snap.version_id[:12], loc.describe(), exc)


def publish(ctx: EngineContext, req: CommitRequest, snap: Snapshot, redundancy: Redundancy,
            started: float, lease: str, progress: ProgressCallback | None = None, *,
            manifest: Future[LocationSet | None] | None = None) -> Version:
    """Store the manifest, then make the version visible (its chunks must be durable).

    ``lease`` is the commit's GC lease, begun naming the version (``begin_lease(catalog,
    snap.version_id)``) before the manifest object is written, so a commit that fails from
    here on leaves a tombstone GC may act on; the publishing transaction ends it.

    ``manifest``: the manifest object's write (:func:`store_manifest`), begun already under
    the lease; it is waited for before the publishing transaction begins, so the version is
    never visible before its manifest object is durable. Without it, the manifest object is
    written here first.
    """
    tier = ctx.packs.tier
    if manifest is None:
        store_manifest(ctx, snap)
    else:  # waited for before the transaction: it must not hold the catalog's write lock over I/O
        manifest_stored(ctx, snap, manifest)
    row = _publish(ctx, req, snap, started, redundancy, progress, lease, fast=tier is not None)
    if tier is not None:
        tier.wake()
    if snap.delta is not None:
        snap.delta.published(snap.chunks)
    for name in req.tags:  # a tag given at commit may have moved from another version
        records.record_tag(ctx.locations, ctx.catalog, name, snap.version_id)
    if snap.degraded:
        _warn_degraded(req, snap)
    return Version(
        id=snap.version_id, run=req.run, step=req.step,
        created_at=datetime.fromtimestamp(snap.manifest.created_at, tz=timezone.utc),
        logical_bytes=row["logical_bytes"], new_bytes=snap.new_bytes,
        stored_bytes=snap.stored_bytes, duration_s=row["duration_s"],
        parent=snap.manifest.parent, tags=req.tags, metadata=req.metadata,
        metrics=req.metrics, message=req.message, degraded=bool(snap.degraded),
        durability=row["durability"], stall_s=row["stall_s"],
    )


def _warn_degraded(req: CommitRequest, snap: Snapshot) -> None:
    """One WARNING for a commit some of whose packs are below their redundancy, naming the
    locations that refused shards and what brings the redundancy back."""
    refused = sorted({name for s in snap.degraded for name in s.refused})
    todo = (f"location(s) {', '.join(refused)} refused shards: run `casckpt repair` once they are "
            "back, or mark them failed (`casckpt location fail`), add others (`casckpt location add`) "
            "and repair" if refused else
            "add a location in another failure domain (`casckpt location add`), then `casckpt repair`")
    log.warning("commit %s@%s (%s) is degraded: %d pack(s) are below their redundancy (%s). The "
                "version is committed and readable; %s", req.run, req.step, snap.version_id[:12],
                len(snap.degraded), summary(snap.degraded), todo)


def finish(ctx: EngineContext, req: CommitRequest, snap: Snapshot, redundancy: Redundancy,
           started: float, lease: str, progress: ProgressCallback | None = None) -> Version:
    """Write the snapshot's new chunks (delta-coded against their bases where that pays) and
    manifest, then publish the version.

    The commit holds its lease already, so the manifest object is written on the upload pool
    while the chunks are (it costs a commit that writes nothing new most of its fixed time);
    publishing waits for it. On failure, the manifest's write is waited for before this
    raises: nothing of the commit is written once its lease has ended."""
    snap.delta = encode_plan(ctx, req.run, None, snap.manifest.tensors, snap.manifest.extents,
                             snap.new_ids, bases=snap.bases)
    manifest = ctx.uploads.submit(store_manifest, ctx, snap)
    try:
        snap.wrote(write_chunks(ctx, snap.chunks, snap.new_ids, redundancy, progress, snap.delta, fast=True))
        return publish(ctx, req, snap, redundancy, started, lease, progress, manifest=manifest)
    except BaseException:
        manifest.exception()
        raise


def refuse_existing(ctx: EngineContext, req: CommitRequest) -> None:
    """Refuse a step the run already has (checked again when publishing; this saves the work)."""
    existing = ctx.catalog.at_step(req.run, req.step)
    if existing is not None:
        raise VersionExistsError(
            f"run {req.run!r} already has a version at step {req.step} ({existing.id[:12]}); "
            "commit with another step, or fork a new run"
        )


def commit(ctx: EngineContext, state: object, req: CommitRequest,
           progress: ProgressCallback | None = None, hint: ChangeHint | None = None) -> Version:
    """Store ``state`` as a new version of ``req.run`` (see module docstring for the protocol).

    The commit holds a catalog lease from its first write to its end, so a concurrent GC
    neither condemns the chunks it writes nor deletes its objects as orphans. The lease
    begins after the snapshot (which writes nothing), naming the version in the same
    transaction. Chunks the snapshot found in the store are not the lease's to keep: GC may
    condemn them meanwhile, and publishing revives them or writes them again.
    """
    started, created = time.monotonic(), time.time()
    refuse_existing(ctx, req)
    redundancy = ctx.packs.placement.redundancy_for(req.run)
    ctx.packs.placement.check_writable(redundancy)
    snap = snapshot(ctx, state, req, created, parent=parent_of(ctx, req.run), progress=progress, hint=hint)
    lease = begin_lease(ctx.catalog, snap.version_id)
    try:
        return finish(ctx, req, snap, redundancy, started, lease, progress)
    except BaseException:
        release_lease(ctx.catalog, lease, f"commit {req.run}@{req.step}")  # publishing ends it otherwise
        raise
