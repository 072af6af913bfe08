"""Versions saved by many ranks: each rank writes its own chunks, one coordinator publishes.

The protocol, for ``torch.distributed.checkpoint`` (see :mod:`casckpt.dcp`)
and for ``Store.commit(..., group=)`` (see :mod:`casckpt.engine.write.group`):

1. The coordinator refuses a step the run already has and takes a catalog
   lease *before* any rank writes (:func:`begin_save`): the lease keeps every
   rank's fresh chunks and objects out of GC's reach until the version is
   published (or the save failed and the lease ended, :func:`end_save`). The
   version id is not known yet: the coordinator names it on the lease once it
   has composed the manifest, before writing the manifest object
   (:func:`publish_composed`), as a one-process commit names it when its lease
   begins, so a coordinator killed from there on leaves a tombstone, never an
   unexplained manifest.
2. Every rank chunks, hashes and dedups its own pieces (:func:`save_pieces`)
   and writes the chunks the store does not hold, in packs of its own, under
   a lease of its own too (:func:`rank_lease`: the coordinator's covers the
   ranks' writes only while the coordinator lives). What it wrote is
   described by :class:`StoredPiece` values sent to the coordinator.
3. Only after every rank succeeded, the coordinator composes one manifest
   (:func:`compose`) and publishes it in ONE catalog transaction
   (:func:`publish_save`), then ends the lease. If any rank fails, nothing is
   published: the packs already written are leftovers that GC reclaims like
   those of any failed commit.

:mod:`casckpt.dcp` drives a save through :func:`begin_save`, :func:`save_pieces`,
:func:`publish_save` and :func:`end_save` only, in that order, and never the
catalog.

Words: a *piece* is the part of one tensor one rank saves (DCP calls it a
chunk or shard of a sharded tensor); casckpt keeps "chunk" for the hashed unit
of dedup and "shard" for an erasure-coded fragment of a pack. The manifest
marks a tensor stored as pieces with the node kind ``"sharded"`` and
``TensorEntry.is_shard``; it is a tree manifest like a one-process commit's.

A piece of a tensor split along dim 0 is a contiguous run of the whole
tensor's bytes; it is chunked on the whole tensor's grid (``grid_offset``),
so the same content saved by another number of ranks reuses every chunk
except the few cut by piece boundaries.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from casckpt.catalog.leases import begin_lease, name_version, release_lease, save_lease_id
from casckpt.catalog.leases import (
    rank_lease_id as rank_lease_id,  # for casckpt.dcp, which never imports the catalog
)
from casckpt.engine.context import EngineContext
from casckpt.engine.memory.deltabase import candidate_bases
from casckpt.engine.read.degraded import Shortfall, shortfalls
from casckpt.engine.versions.extents import ExtentSource, pack_limit, plan_extents
from casckpt.engine.write.commit import (
    CommitRequest,
    Snapshot,
    parent_manifest,
    parent_of,
    publish,
    refuse_existing,
)
from casckpt.engine.write.commitchunks import (
    ChunkBytes,
    Progress,
    hash_and_dedup,
    held_elsewhere,
    known_chunks,
    node_chunks,
    pack_chunks,
    write_chunks,
)
from casckpt.engine.write.encodepolicy import EncodePlan, encode_plan, live_bases
from casckpt.engine.write.packer import Packer
from casckpt.format.manifest import ExtentEntry, Manifest, TensorEntry, World
from casckpt.format.state import Node, TensorLeaf
from casckpt.format.treemanifest import encode_tree_manifest, headed
from casckpt.storage.erasure import Redundancy
from casckpt.types import ProgressCallback, Version


@dataclass(frozen=True, slots=True)
class TensorPiece:
    """A piece of a tensor one rank saves: the box at ``global_offset`` of a ``global_shape`` tensor.

    ``global_shape`` None: the tensor is saved whole by this rank.
    """

    path: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class StoredPiece:
    """What a rank stored for one piece: sent to the coordinator (plain, small values)."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    extent: ExtentEntry
    global_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None
    offset: int = 0  # where it starts in its extent (a small piece packed with others)
    digest: bytes | None = None  # a packed piece's own chunk id


@dataclass(frozen=True, slots=True)
class RankWrite:
    """A rank's share of a version: its pieces, the bytes it wrote, and the packs it wrote below
    their redundancy."""

    pieces: tuple[StoredPiece, ...]
    new_bytes: int
    stored_bytes: int
    degraded: tuple[Shortfall, ...] = ()


def _grid_offset(piece: TensorPiece, itemsize: int) -> int:
    """Where the piece's bytes start in the whole tensor's bytes, when they are one run there."""
    if piece.global_shape is None or piece.global_offset is None or not piece.tensor.dim():
        return 0
    shape, whole = tuple(piece.tensor.shape), piece.global_shape
    if shape[1:] != whole[1:]:
        return 0  # not whole rows: the piece is strided in the whole tensor; chunk it on its own
    return piece.global_offset[0] * math.prod(whole[1:]) * itemsize


def write_pieces(ctx: EngineContext, pieces: Sequence[TensorPiece], redundancy: Redundancy,
                 progress: ProgressCallback | None = None, *, run: str | None = None) -> RankWrite:
    """Chunk, hash and dedup ``pieces``; write the chunks the store does not hold, through the
    commit's encoder (:func:`~casckpt.engine.write.commitchunks.pack_chunks`): small pieces packed
    together, and, with ``run``, chunks delta-coded against the run's latest version where that
    pays, as a one-process commit's are.

    Pipelined by windows of about half a pack: a thread plans and hashes the next window
    (and confirms its chunks in the catalog) while this one encodes and packs the new chunks
    of the window before, so hashing overlaps packing and the first packs reach the disk
    early. A piece that cannot be stored is refused before the first chunk is packed; every
    chunk is written once, whichever windows it occurs in. The chunks are
    durable (and in the catalog, unreferenced) when this returns; nothing is visible until
    the coordinator publishes the version.
    """
    windows = list(_windows(pieces, max(ctx.config.pack_size // 2, ctx.config.chunk_size)))
    total = sum(p.tensor.nbytes for p in pieces)
    hashing = Progress(progress, "hash", total)
    writing = Progress(progress, "write", total)  # advanced by new bytes: ends below total
    stored: list[StoredPiece] = []
    taken: set[bytes] = set()  # chunks written (or being written) by an earlier window
    packer = Packer(ctx, redundancy)
    candidates: dict[bytes, bytes] = {}  # the delta plan's: filled window by window
    delta, before = _delta(ctx, run, candidates)
    with ThreadPoolExecutor(1, thread_name_prefix="casckpt-hash") as ahead:
        hashed: list[Future[_Hashed]] = []
        try:
            if windows:
                hashed.append(ahead.submit(_hash_window, ctx, windows[0]))
            # planning refuses a torch tensor for its dtype alone: one piece of each dtype,
            # planned now, refuses the state before anything is packed (the rest are planned
            # with their window, on the hashing thread)
            for piece in {p.tensor.dtype: p for p in reversed(pieces)}.values():
                _plan(ctx, [piece])
            for i, part in enumerate(windows):
                if i + 1 < len(windows):  # the next window hashes while this one is packed
                    hashed.append(ahead.submit(_hash_window, ctx, windows[i + 1]))
                window = hashed[i].result()
                hashing.advance(sum(p.tensor.nbytes for p in part))
                stored.extend(window.pieces)
                fresh = [cid for cid in window.new_ids if cid not in taken]
                taken.update(fresh)
                if delta is not None and before is not None:
                    _bases(ctx, delta, candidates, before, window, fresh)
                pack_chunks(ctx, packer, window.chunks, fresh, delta, writing)
            packs = packer.finish()
            if delta is not None:  # this rank's new chunks are the bases of its next save
                delta.published(c for p in stored for c in p.extent.chunks)
        except BaseException:
            packer.abort()
            for future in hashed:
                future.cancel()
            raise
    return RankWrite(tuple(stored), writing.done, packer.stored_bytes,
                     tuple(shortfalls(ctx, (p.layout for p in packs))))


@dataclass(frozen=True, slots=True)
class _Hashed:
    """A window of pieces, hashed: what each stored, every chunk's bytes, the new chunks."""

    pieces: list[StoredPiece]
    chunks: dict[bytes, ChunkBytes]
    new_ids: list[bytes]


def _windows(pieces: Sequence[TensorPiece], size: int) -> Iterator[list[TensorPiece]]:
    """``pieces`` in order, in runs of about ``size`` bytes (a larger piece is a run alone)."""
    run: list[TensorPiece] = []
    nbytes = 0
    for piece in pieces:
        if run and nbytes + piece.tensor.nbytes > size:
            yield run
            run, nbytes = [], 0
        run.append(piece)
        nbytes += piece.tensor.nbytes
    if run:
        yield run


def _delta(ctx: EngineContext, run: str | None, candidates: dict[bytes, bytes]
           ) -> tuple[EncodePlan | None, Manifest | None]:
    """How this rank encodes (None: no run), and the manifest of the run's latest version it
    delta-codes against (its bases: what this process saved last; None: no deltas)."""
    if run is None:
        return None, None
    plan = encode_plan(ctx, run, None, [], [], [], bases=candidates)
    return plan, None if plan.chain is None else parent_manifest(ctx, run, parent_of(ctx, run))


def _bases(ctx: EngineContext, plan: EncodePlan, candidates: dict[bytes, bytes], before: Manifest,
           window: _Hashed, fresh: Sequence[bytes]) -> None:
    """Add the delta bases of a window's new chunks to ``plan`` (those still live in the store)."""
    entries = [TensorEntry(p.path, "torch", p.dtype, p.shape, i, global_offset=p.global_offset)
               for i, p in enumerate(window.pieces)]
    found = candidate_bases(before, entries, [p.extent for p in window.pieces], fresh)
    plan.live |= live_bases(ctx, found)
    plan.name(entries, [p.extent for p in window.pieces])
    candidates.update(found)


def _plan(ctx: EngineContext, pieces: Sequence[TensorPiece]) -> tuple[list[TensorEntry], list[ExtentSource]]:
    """Each piece's entry and extent source (raises for a piece that cannot be stored): small
    pieces packed together as a one-process commit packs small tensors, every other piece an
    extent of its own (even views of one storage)."""
    limit = pack_limit(ctx.config.chunk_size)
    small = {i for i, p in enumerate(pieces) if p.tensor.nbytes <= limit}
    if len({pieces[i].tensor.untyped_storage().data_ptr() for i in small}) < len(small):
        small = set()  # views of one storage: each stored as it is
    entries: list[TensorEntry | None] = [None] * len(pieces)
    sources: list[ExtentSource] = []
    if small:
        order = sorted(small)
        packed, packed_sources = plan_extents([TensorLeaf(pieces[i].path, "torch", pieces[i].tensor)
                                               for i in order],
                                              pack=limit, ids=ctx.crypto.chunk_id)
        for i, entry in zip(order, packed, strict=True):
            entries[i] = entry
        sources.extend(packed_sources)
    for i, piece in enumerate(pieces):
        if i in small:
            continue
        (entry,), (source,) = plan_extents([TensorLeaf(piece.path, "torch", piece.tensor)],
                                           ids=ctx.crypto.chunk_id)
        source.grid_offset = _grid_offset(piece, piece.tensor.element_size())
        entries[i] = replace(entry, extent=len(sources))
        sources.append(source)
    return [e for e in entries if e is not None], sources


def _hash_window(ctx: EngineContext, pieces: Sequence[TensorPiece]) -> _Hashed:
    entries, sources = _plan(ctx, pieces)
    # confirmed in the catalog, not taken from this host's cache: the coordinator could not
    # write a chunk this rank wrongly skipped
    extents, chunks, new_ids = hash_and_dedup(ctx, sources, None, confirm=True)
    stored = [StoredPiece(p.path, e.dtype, e.shape, extents[e.extent], p.global_shape, p.global_offset,
                          e.offset, e.digest)
              for p, e in zip(pieces, entries, strict=True)]
    return _Hashed(stored, chunks, new_ids)


def compose(ctx: EngineContext, req: CommitRequest, parent: str | None, created: float, world: World,
            root: Node, entries: Sequence[TensorEntry], extents: Sequence[ExtentEntry], new_bytes: int,
            stored_bytes: int, degraded: Sequence[Shortfall] = ()) -> Snapshot:
    """The snapshot of a version whose chunks the ranks wrote already, as a tree manifest
    (:mod:`casckpt.format.treemanifest`): its tree nodes the store lacks are written here;
    publishing re-checks the ranks' chunks, it cannot write them again. ``degraded``: the
    packs the ranks wrote below their redundancy."""
    manifest = Manifest(
        run=req.run, step=req.step, parent=parent, created_at=created, root=root,
        tensors=tuple(entries), extents=tuple(extents), metadata=req.metadata, metrics=req.metrics,
        message=req.message, tags=req.tags, world=world,
    )
    version_id, manifest_bytes, tree = encode_tree_manifest(manifest, None, ctx.crypto.chunk_id)
    chunks = held_elsewhere(cid for b in extents for cid in b.chunks)
    nodes = node_chunks(tree)
    known = known_chunks(ctx, list(nodes), confirm=True)
    chunks.update(nodes)
    snap = Snapshot(headed(manifest, tree), version_id, manifest_bytes, chunks, [], tree)
    snap.degraded = list(degraded)
    snap.wrote(write_chunks(ctx, nodes, [n for n in nodes if n not in known],
                            ctx.packs.placement.redundancy_for(req.run), None))  # nodes: no bytes counted
    snap.new_bytes, snap.stored_bytes = new_bytes, stored_bytes
    return snap


def piece_entries(pieces: Sequence[StoredPiece]) -> tuple[list[TensorEntry], list[ExtentEntry]]:
    """Manifest entries for ``pieces``: piece ``i`` becomes tensor ``i`` with extent ``i``."""
    entries = [TensorEntry(p.path, "torch", p.dtype, p.shape, i, p.offset, global_shape=p.global_shape,
                           global_offset=p.global_offset, digest=p.digest) for i, p in enumerate(pieces)]
    return entries, [p.extent for p in pieces]


# -- the coordinator's side, as casckpt.dcp drives it ---------------------------------------


@dataclass(frozen=True, slots=True)
class SaveStart:
    """What the coordinator fixed before any rank wrote (:func:`begin_save`)."""

    parent: str | None  # the new version's parent
    created: float  # the version's creation time (epoch seconds)
    started: float  # time.monotonic() at the start, for the version's duration
    lease: str  # the GC lease the save holds until :func:`publish_save` or :func:`end_save`


def begin_save(ctx: EngineContext, req: CommitRequest) -> SaveStart:
    """Coordinator, before any rank writes: refuse a step the run already has, check the
    locations can take the run's packs, fix the parent, and take the GC lease.

    Raises:
        VersionExistsError: the run has a version at this step.
        StorageError: fewer active failure domains than the run's write quorum.
    """
    started, created = time.monotonic(), time.time()
    refuse_existing(ctx, req)
    ctx.packs.placement.check_writable(ctx.packs.placement.redundancy_for(req.run))
    parent = parent_of(ctx, req.run)
    return SaveStart(parent, created, started, begin_lease(ctx.catalog, lease=save_lease_id()))


@contextmanager
def rank_lease(ctx: EngineContext, lease: str | None) -> Iterator[None]:
    """A GC lease of a rank's own, with id ``lease``, around its writes (None: the rank is the
    coordinator, whose save lease covers it already). The coordinator's lease covers every
    rank's writes only while the coordinator lives: once it is killed, GC reaps that lease,
    and a rank still writing would have put pack objects it has not recorded yet where GC
    takes them for orphans -- then record live chunk rows over objects GC deleted, which the
    next save dedups against. The rank ends its lease when its writes end; a lease id from
    :func:`~casckpt.catalog.leases.rank_lease_id` ends with the save too (:func:`end_save`),
    so a rank killed on another host (never judged by pid) does not hold GC back for a day."""
    if lease is None:
        yield
        return
    begin_lease(ctx.catalog, lease=lease)
    try:
        yield
    finally:
        release_lease(ctx.catalog, lease, "a rank's writes for a save")


def save_pieces(ctx: EngineContext, req: CommitRequest, pieces: Sequence[TensorPiece],
                lease: str | None = "") -> RankWrite:
    """Every rank: :func:`write_pieces` with the run's redundancy, under a lease of its own
    (:func:`rank_lease`; ``lease`` None: the coordinator's, "": a fresh id)."""
    with rank_lease(ctx, lease if lease != "" else uuid.uuid4().hex):
        return write_pieces(ctx, pieces, ctx.packs.placement.redundancy_for(req.run), run=req.run)


def publish_save(ctx: EngineContext, req: CommitRequest, start: SaveStart, world: World, root: Node,
                 pieces: Sequence[StoredPiece], new_bytes: int, stored_bytes: int,
                 degraded: Sequence[Shortfall]) -> Version:
    """Coordinator, after every rank succeeded: compose the manifest from every rank's pieces
    (``root`` refers to them by index) and publish it in one catalog transaction. The lease
    stays: the caller ends it (:func:`end_save`) whether or not publishing succeeded.

    Raises:
        VersionExistsError: the step was taken meanwhile.
    """
    entries, extents = piece_entries(pieces)
    snap = compose(ctx, req, start.parent, start.created, world, root, entries, extents, new_bytes,
                   stored_bytes, degraded)
    return publish_composed(ctx, req, snap, start.started, start.lease)


def publish_composed(ctx: EngineContext, req: CommitRequest, snap: Snapshot, started: float,
                     lease: str) -> Version:
    """Coordinator: name the composed version on the save's lease (taken before the version id
    was known), then write its manifest object and publish it (:func:`publish`). Named first,
    so a coordinator killed between the manifest write and the publishing transaction leaves
    a manifest GC knows: a commit in flight while the lease lives, a tombstone once GC reaps it.

    Raises:
        CatalogError: the lease is gone (reaped as older than a day); nothing was written.
        VersionExistsError: the step was taken meanwhile.
    """
    ctx.catalog.retrying(lambda: name_version(ctx.catalog, lease, snap.version_id))  # idempotent
    return publish(ctx, req, snap, ctx.packs.placement.redundancy_for(req.run), started, lease)


def end_save(ctx: EngineContext, lease: str) -> None:
    """End the GC lease of a save, published or not, and its ranks' (:func:`rank_lease`); a
    catalog that cannot is reported, not raised (:func:`~casckpt.catalog.leases.release_lease`).
    The version the lease named, if any and unpublished, is tombstoned. Idempotent."""
    release_lease(ctx.catalog, lease, "a save of many ranks", ranks=True)
