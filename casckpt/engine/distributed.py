"""Versions saved by many ranks: each rank writes its own chunks, one coordinator publishes.

The protocol, for ``torch.distributed.checkpoint`` (see :mod:`casckpt.dcp`)
and for ``Store.commit(..., group=)`` (see :mod:`casckpt.engine.group`):

1. The coordinator refuses a step the run already has and takes a catalog
   lease *before* any rank writes: the lease keeps every rank's fresh chunks
   and objects out of GC's reach until the version is published (or the
   save failed and the lease ended).
2. Every rank chunks, hashes and dedups its own pieces (:func:`write_shards`)
   and writes the chunks the store does not hold, in packs of its own. What
   it wrote is described by :class:`StoredShard` values sent to the coordinator.
3. Only after every rank succeeded, the coordinator composes one manifest
   (:func:`compose`) and publishes it in ONE catalog transaction. If any rank
   fails, nothing is published: the packs already written are leftovers that
   GC reclaims like those of any failed commit.

A shard of a tensor split along dim 0 is a contiguous run of the whole
tensor's bytes; it is chunked on the whole tensor's grid (``grid_offset``),
so the same content saved by another number of ranks reuses every chunk
except the few cut by shard boundaries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from casckpt.engine.commit import CommitRequest, Snapshot
from casckpt.engine.commitchunks import hash_and_dedup, held_elsewhere, write_chunks
from casckpt.engine.context import EngineContext
from casckpt.engine.degraded import Shortfall
from casckpt.engine.layout import plan_blobs
from casckpt.engine.tensorrows import tensor_rows
from casckpt.format.manifest import BlobEntry, Manifest, TensorEntry, World, encode_manifest
from casckpt.format.tree import Node, TensorLeaf
from casckpt.storage.erasure import Redundancy
from casckpt.types import ProgressCallback


@dataclass(frozen=True, slots=True)
class ShardPiece:
    """A piece of a tensor one rank saves: the box at ``global_offset`` of a ``global_shape`` tensor.

    ``global_shape`` None: the tensor is saved whole by this rank.
    """

    path: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class StoredShard:
    """What a rank stored for one piece: sent to the coordinator (plain, small values)."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    blob: BlobEntry
    global_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class RankWrite:
    """A rank's share of a version: its shards, the bytes it wrote, and the packs it wrote below
    their redundancy."""

    shards: tuple[StoredShard, ...]
    new_bytes: int
    stored_bytes: int
    degraded: tuple[Shortfall, ...] = ()


def _grid_offset(piece: ShardPiece, itemsize: int) -> int:
    """Where the piece's bytes start in the whole tensor's bytes, when they are one run there."""
    if piece.global_shape is None or piece.global_offset is None or not piece.tensor.dim():
        return 0
    shape, whole = tuple(piece.tensor.shape), piece.global_shape
    if shape[1:] != whole[1:]:
        return 0  # not whole rows: the piece is strided in the whole tensor; chunk it on its own
    return piece.global_offset[0] * math.prod(whole[1:]) * itemsize


def write_shards(ctx: EngineContext, pieces: Sequence[ShardPiece], redundancy: Redundancy,
                 progress: ProgressCallback | None = None) -> RankWrite:
    """Chunk, hash and dedup ``pieces``; write the chunks the store does not hold.

    The chunks are durable (and in the catalog, unreferenced) when this returns;
    nothing is visible until the coordinator publishes the version.
    """
    entries, sources = [], []
    for piece in pieces:  # one blob per piece, even for views of one storage
        (entry,), (source,) = plan_blobs([TensorLeaf(piece.path, "torch", piece.tensor)],
                                         stage_host=ctx.config.stage_host_tensors)
        source.grid_offset = _grid_offset(piece, piece.tensor.element_size())
        entries.append(entry)
        sources.append(source)
    # confirmed in the catalog, not taken from this host's cache: the coordinator could not
    # write a chunk this rank wrongly skipped
    blobs, chunks, new_ids = hash_and_dedup(ctx, sources, progress, confirm=True)
    written = write_chunks(ctx, chunks, new_ids, redundancy, progress)
    shards = tuple(
        StoredShard(p.path, e.dtype, e.shape, blob, p.global_shape, p.global_offset)
        for p, e, blob in zip(pieces, entries, blobs, strict=True)
    )
    return RankWrite(shards, written.raw_bytes, written.stored_bytes, written.degraded)


def compose(req: CommitRequest, parent: str | None, created: float, world: World, root: Node,
            entries: Sequence[TensorEntry], blobs: Sequence[BlobEntry], new_bytes: int,
            stored_bytes: int, degraded: Sequence[Shortfall] = ()) -> Snapshot:
    """The snapshot of a version whose chunks the ranks wrote already (nothing is left to write:
    publishing re-checks the chunks, it cannot write them again); ``degraded``: the packs the
    ranks wrote below their redundancy."""
    manifest = Manifest(
        run=req.run, step=req.step, parent=parent, created_at=created, root=root,
        tensors=tuple(entries), blobs=tuple(blobs), metadata=req.metadata, metrics=req.metrics,
        message=req.message, tags=req.tags, world=world,
    )
    version_id, manifest_bytes = encode_manifest(manifest)
    rows, content_rows = tensor_rows(version_id, entries, blobs)
    chunks = held_elsewhere(cid for b in blobs for cid in b.chunks)
    snap = Snapshot(manifest, version_id, manifest_bytes, chunks, [], rows, content_rows)
    snap.new_bytes, snap.stored_bytes = new_bytes, stored_bytes
    snap.degraded = list(degraded)
    return snap


def shard_entries(shards: Sequence[StoredShard]) -> tuple[list[TensorEntry], list[BlobEntry]]:
    """Manifest entries for ``shards``: shard ``i`` becomes tensor ``i`` with blob ``i``."""
    entries = [TensorEntry(shard.path, "torch", shard.dtype, shard.shape, i, global_shape=shard.global_shape,
                           global_offset=shard.global_offset) for i, shard in enumerate(shards)]
    return entries, [shard.blob for shard in shards]
